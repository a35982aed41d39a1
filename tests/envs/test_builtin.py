"""The built-in environments and the env config's bad values, each named."""

import pytest

from jgrpo.config import Config, ConfigError, EnvConfig
from jgrpo.config.loading import load_config
from jgrpo.envs.base import Turn
from jgrpo.envs.builtin import CalculatorEnvironment, GuessNumberEnvironment, environment_class
from tests.helpers import TINY_YAML


def turn(text):
    return Turn(0, (), text, (), None, False)


def test_guess_number_says_higher_lower_and_ends_on_the_number():
    env = GuessNumberEnvironment(Config())
    opening = env.reset({"question": "", "secret": 42}, seed=7)
    assert "from 1 to 100" in opening[-1]["content"]
    assert env.step(turn("I guess 50.")) == ([{"role": "user", "content": "Lower."}], 0.0, False, None)
    assert env.step(turn("Then 20")).reply == [{"role": "user", "content": "Higher."}]
    no_number = env.step(turn("hmm"))
    assert not no_number.done and no_number.info == {"no_guess": 1}
    assert env.step(turn("It is 42")) == ([], 1.0, True, None)
    # Without a secret in the row, the seed draws it: the same seed, the same number.
    a, b = GuessNumberEnvironment(Config()), GuessNumberEnvironment(Config())
    a.reset({"question": ""}, seed=3), b.reset({"question": ""}, seed=3)
    assert a.secret == b.secret and 1 <= a.secret <= 100


def test_calculator_environment_tools_follow_env_tools():
    assert [t.name for t in CalculatorEnvironment(Config(env=EnvConfig(name="calculator"))).tools] == ["calculator"]
    assert CalculatorEnvironment(Config(env=EnvConfig(name="calculator", tools=()))).tools == []
    opening = CalculatorEnvironment(Config()).reset({"question": "What is 345 * 67?"}, 0)
    assert opening[-1] == {"role": "user", "content": "What is 345 * 67?"}
    assert environment_class("calculator") is CalculatorEnvironment
    with pytest.raises(ValueError, match="unknown environment 'calc'"):
        environment_class("calc")
    with pytest.raises(ValueError, match="has no Environment subclass named 'Nope'"):
        environment_class("tests.envs.scripted_envs:Nope")


@pytest.mark.parametrize("overrides, message", [
    (["env.name=calc"], "env.name='calc' is not allowed: one of none, calculator, guess_number or module:Class"),
    (["env.name=calculator", "env.tools=[search]"], "env.tools=['search'] is not allowed"),
    (["env.name=calculator", "env.max_total_tokens=4"], "env.max_total_tokens=4 is not allowed: >= "
                                                         "sampler.max_new_tokens=8"),
    (["env.name=calculator", "env.timeout_s=0"], "env.timeout_s=0.0 is not allowed"),
])
def test_bad_env_config_names_the_key(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(TINY_YAML, overrides)
    assert message in str(error.value)
