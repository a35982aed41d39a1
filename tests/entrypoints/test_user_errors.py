"""Bad input through the real entrypoints: one `error:` paragraph on stderr, exit status 2, no traceback.

Every case runs `python -m jgrpo.<entrypoint>` in its own process, all of them at once (each is a Python start
and the imports; none loads a model). Where the check belongs before the model loads, the case also names a
model that does not exist: had jgrpo tried to load it first, the message would be about the model instead.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, child_xla_flags

NO_MODEL = "model.name=/nonexistent/model.gguf"  # loading it would fail: the expected error must come first
LOG_LINE = re.compile(r"^\d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR) ")


def _files(tmp: Path) -> dict:
    (tmp / "syntax.yaml").write_text("model:\n  name: [tiny\nsampler:\n  temperature: 1.0\n")
    (tmp / "list.yaml").write_text("- model\n- sampler\n")
    (tmp / "a_file").write_text("not a directory\n")
    (tmp / "hf_model").mkdir()
    (tmp / "hf_model" / "config.json").write_text("{}\n")
    (tmp / "latin1.jsonl").write_bytes(b'{"question": "What is 1 + 1?", "answer": "2"}\n'
                                       b'{"question": "Qu\xe9 es 2 + 2?", "answer": "4"}\n')
    return {"tmp": tmp}


# (id, entrypoint, arguments, what the message must say); {tmp} is the case's scratch directory.
CASES = [
    ("yaml_syntax", "train", ["{tmp}/syntax.yaml"], r"syntax\.yaml: line 3, column \d+: invalid YAML"),
    ("top_level_list", "train", ["{tmp}/list.yaml"], r"list\.yaml: the file is a list; a config file must be a"),
    ("unknown_key", "train", ["configs/tiny.yaml", "grpo.betta=0.1"],
     r"unknown config key 'grpo\.betta'; did you mean beta"),
    ("wrong_type", "train", ["configs/tiny.yaml", "sampler.max_new_tokens=many"],
     r"sampler\.max_new_tokens='many' is not allowed: expected an integer"),
    ("negative_size", "train", ["configs/tiny.yaml", "data.batch_size=-2"], r"data\.batch_size=-2 is not allowed"),
    ("missing_config", "train", ["configs/no_such.yaml"], r"config file not found: configs/no_such\.yaml"),
    ("override_without_equals", "train", ["configs/tiny.yaml", "grpo.beta"], r"override 'grpo\.beta' has no '='"),
    ("mesh_too_big", "train", ["configs/tiny.yaml", "mesh.data=3", "mesh.fsdp=5", NO_MODEL],
     r"mesh\.data=3 x mesh\.fsdp=5 x mesh\.expert=1 x mesh\.tensor=1 needs 15 devices but 8 are available"),
    ("output_dir_is_a_file", "train", ["configs/tiny.yaml", "run.output_dir={tmp}/a_file", NO_MODEL],
     r"run\.output_dir='.*a_file' is a file, not a directory"),
    ("output_dir_not_writable", "train", ["configs/tiny.yaml", "run.output_dir=/proc/jgrpo-run", NO_MODEL],
     r"run\.output_dir='/proc/jgrpo-run' cannot be written"),
    ("unknown_reward", "train", ["configs/tiny.yaml", "reward.functions=[exact_numerik]", NO_MODEL],
     r"unknown reward function 'exact_numerik'; did you mean exact_numeric"),
    ("reward_module_missing", "train", ["configs/tiny.yaml", "reward.functions=[no_such_module:score]", NO_MODEL],
     r"cannot import module 'no_such_module' of reward 'no_such_module:score'"),
    ("data_file_missing", "train", ["configs/tiny.yaml", "data.source={tmp}/missing.jsonl", NO_MODEL],
     r"data\.source='.*missing\.jsonl': no such file or directory .* a built-in task \(arithmetic, countdown, "
     r"word_problems\)"),
    ("builtin_task_split", "train", ["configs/tiny.yaml", "data.split=validation", NO_MODEL],
     r"data\.split='validation': the built-in task 'arithmetic' has the splits 'train' and 'test'"),
    ("no_examples", "train", ["configs/tiny.yaml", "data.source=word_problems", "data.num_examples=0", NO_MODEL],
     r"data\.num_examples=0 is not allowed: a positive integer"),
    ("temperature_zero", "train", ["configs/tiny.yaml", "sampler.temperature=0", NO_MODEL],
     r"sampler\.temperature=0 \(greedy\) cannot train"),
    ("batch_not_divisible", "train", ["configs/tiny.yaml", "grpo.micro_batches=3"],
     r"16 rows must split into grpo\.num_minibatches \* grpo\.micro_batches = 1 \* 3 equal parts"),
    ("bad_utf8_row", "train", ["configs/tiny.yaml", "data.source={tmp}/latin1.jsonl", "data.format=custom",
                               "run.output_dir={tmp}/run"],
     r"latin1\.jsonl: line 2: not valid UTF-8 at byte 16 of the line \(set data\.skip_bad_rows=true"),
    ("eval_not_a_run", "eval", ["{tmp}"], r"is neither a run directory \(no config\.yaml\) nor a model directory"),
    ("eval_model_without_data", "eval", ["{tmp}/hf_model", "--reward", "gsm8k"],
     r"hf_model is a model directory: it brings no data and no reward; give --data FILE and --reward NAME"),
    ("export_not_a_run", "export", ["{tmp}", "{tmp}/out"], r"is not a run directory \(no config\.yaml\)"),
    ("plot_no_metrics", "plot", ["{tmp}", "-o", "{tmp}/curves.png"], r"metrics\.jsonl: no metrics"),
    ("sample_no_such_model", "sample", ["/nonexistent/model", "--prompt", "hi"],
     r"model '/nonexistent/model': no such directory or \.gguf file"),
    ("sandbox_package_missing", "train", ["configs/tiny_tools.yaml", "env.tools=[python]",
                                          "env.sandbox_packages=[no-such-dist]", NO_MODEL],
     r"env\.sandbox_packages names 'no-such-dist', which is not installed"),
    ("plan_unknown_topology", "plan", ["configs/tiny.yaml", "--topology", "v9:2x2"], r"unknown TPU topology 'v9:2x2'"),
]


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "JGRPO_DEBUG"}
    return {**env, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": child_xla_flags(8),
            "HF_HUB_OFFLINE": "1", **extra}


def _start(entrypoint: str, args: list[str], tmp: Path, **env) -> subprocess.Popen:
    args = [a.replace("{tmp}", str(tmp)) for a in args]
    if entrypoint == "train" and not any(a.startswith("run.output_dir=") for a in args) and args[0].endswith(".yaml"):
        args.append(f"run.output_dir={tmp}/run")
    return subprocess.Popen([sys.executable, "-m", f"jgrpo.{entrypoint}", *args], cwd=ROOT, env=_env(**env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Every case started at once, then collected: {id: (returncode, stdout, stderr)}."""
    procs, tmps = {}, {}
    for case_id, entrypoint, args, _ in CASES:
        tmps[case_id] = tmp = tmp_path_factory.mktemp(case_id)
        _files(tmp)
        procs[case_id] = _start(entrypoint, args, tmp)
    outputs = {case_id: p.communicate(timeout=300) for case_id, p in procs.items()}
    return {case_id: (procs[case_id].returncode, *outputs[case_id], tmps[case_id]) for case_id in procs}


@pytest.mark.parametrize("case_id,entrypoint,args,message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_paragraph_and_exit_status_2(outcomes, case_id, entrypoint, args, message):
    code, out, err, _ = outcomes[case_id]
    assert "Traceback" not in err + out, err[-3000:]
    paragraph = [line for line in err.splitlines() if line.strip() and not LOG_LINE.match(line)]
    assert paragraph and paragraph[0].startswith("error: "), err[-3000:]
    assert len(paragraph) <= 4, paragraph
    assert re.search(message, " ".join(line.strip() for line in paragraph)), paragraph
    assert code == 2, (code, err[-3000:])


def test_the_python_tool_without_bubblewrap_is_refused_at_start(tmp_path):
    """`env.sandbox: auto` never runs a model's code unconfined: without bwrap (a PATH without it) the python tool
    is refused before the model loads, naming the package to install and the key that accepts a plain process."""
    proc = _start("train", ["configs/tiny_tools.yaml", "env.tools=[python]", NO_MODEL], tmp_path,
                  PATH=str(Path(sys.executable).parent))
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "Traceback" not in err, err[-3000:]
    assert re.search(r"error: env\.sandbox=auto: .* bubblewrap.*\(bwrap is not installed\).*apt-get install "
                     r"bubblewrap.*env\.sandbox=process", err), err[-3000:]


def test_a_run_that_fails_to_start_leaves_no_config_behind(outcomes):
    # The bad row is found while the trainer loads its data, after the checks before loading: a config.yaml
    # written before would make the next start warn "config differs" against a run that never ran.
    *_, tmp = outcomes["bad_utf8_row"]
    assert (tmp / "run").is_dir() and not (tmp / "run" / "config.yaml").exists()


def test_jgrpo_debug_shows_the_traceback_of_a_user_error(tmp_path):
    proc = _start("train", ["configs/tiny.yaml", "grpo.betta=0.1"], tmp_path, JGRPO_DEBUG="1")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "Traceback" in err and "ConfigError: unknown config key 'grpo.betta'" in err


def test_a_bug_keeps_its_traceback():
    from jgrpo.config.errors import ConfigError, exits_on_user_error

    @exits_on_user_error
    def main():
        raise KeyError("a bug")

    @exits_on_user_error
    def user_mistake():
        raise ConfigError("grpo.beta=-1 is not allowed")

    with pytest.raises(KeyError):
        main()
    assert user_mistake() == 2
