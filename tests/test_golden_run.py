"""The tiny config still trains as the commit before the rooms did (tests/testdata/golden_run.json).

The golden file holds what commit e0d0fa3 (the last commit before jgrpo/ was grouped into rooms) did in six
rollout modes: the completion token ids of every update, every per-iteration metric but wall-clock ones, and the
final params' per-leaf L1 / L2 norms. It was recorded by
`python scripts/compare_with_commit.py e0d0fa3 --write-golden tests/testdata/golden_run.json`, except its
`sync_v4_recentred_m2po` mode, re-recorded on 2026-12-05 (`--modes sync_v4_recentred_m2po` at the commit that
made `grpo.m2po_form: paper` the default: M2PO's mask instead of the clip, an intended change). (The paged KV cache
(#68) first read the tiny config's few-entry page tables in blocks of 16 entries, and the padding's other summation
order flipped one token of `dynamic_sampling`'s second update; since its block covers the table, every mode samples
the recorded tokens again.) This checkout is
run the same way, in a fresh process on 2 emulated devices, and must sample the same token ids, and land within
RTOL of every metric and norm.

Exact equality (the params' sha256 included) is the same-machine check of the script itself. Across machines XLA's
CPU code differs by processor: the golden file came from another machine of this project's kind than the one this
test was written on, and there (2026-12-04) every mode sampled the same token ids, but metrics after a few AdamW
steps at lr 1e-2 differed by up to 3.3e-5 relative (window's theorem1/surrogate_alpha at iteration 4, -0.0495388
vs -0.0495404; 1e-5 on ratio_max, tv and the lower bound of the off-policy mode) and one leaf's L1 norm by 1e-6.
So RTOL is 1e-4, 3x the largest seen, far below what a changed formula or order of operations on values (not on
rounding) would move. Metrics below ATOL in size are float32 rounding residue (the mean of advantages that sum to
zero, ~2e-7; the policy loss at ratio 1) that another summation order changes by its own size. The Theorem 1 lower
bound multiplies such a residue (the TV between a policy and itself, ~4e-7) by the weight M (~60): it moved by
up to 2.6e-5 between the machines at iterations where it is itself ~5e-5, hence its own floor. Token ids are
not so tolerant: an AVX-512 machine (2026-12-07) drew another token at sync_v4_recentred_m2po's 4th update, from
code with fused multiply-adds; compiled for AVX at most (as the recorder now does on x86: docs/testing.md) it
draws the recorded ones.
"""

import importlib.util
import json

from tests.helpers import ROOT, TESTDATA

GOLDEN = TESTDATA / "golden_run.json"
RTOL, ATOL = 1e-4, 1e-6
RESIDUE = {"theorem1/lower_bound": 1e-4}
# Metrics made after the recording (nothing to compare them with): rows the paged cache preempted (#68), the
# versions per row and the slots' use that async logs (#71).
ADDED = frozenset({"sampler/preempted", "rollout/versions_per_row", "rollout/versions_per_row_max",
                   "rollout/slot_utilization"})


def _compare_script():
    spec = importlib.util.spec_from_file_location("compare_with_commit", ROOT / "scripts" / "compare_with_commit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_mode_trains_as_the_golden_run_recorded(tmp_path):
    script = _compare_script()
    golden = json.loads(GOLDEN.read_text())
    assert sorted(golden) == sorted(script.MODES)  # a mode added to the script needs a new recording
    out = tmp_path / "ours.json"
    script.run_recorder(ROOT, list(script.MODES), out)
    ours = json.loads(out.read_text())
    found = {mode: script.differences(ours[mode], golden[mode], rtol=RTOL, atol=ATOL, atol_by_key=RESIDUE,
                                      added=ADDED)
             for mode in script.MODES}
    assert {mode: f for mode, f in found.items() if f} == {}
    # The recording is not empty: each mode trained, and every metric record came through.
    assert all(len(ours[m]["tokens"]) >= script.MODES[m][0] and len(ours[m]["metrics"]) == script.MODES[m][0]
               for m in script.MODES)


def test_the_comparison_can_fail():
    script = _compare_script()
    golden = json.loads(GOLDEN.read_text())["sync_v1"]
    assert script.differences(golden, golden, rtol=RTOL, atol=ATOL, atol_by_key=RESIDUE) == []
    flipped = json.loads(json.dumps(golden))
    flipped["tokens"][1][0][0] += 1
    record = flipped["metrics"][2]
    key = next(k for k, v in record.items() if isinstance(v, float) and abs(v) > 1)
    record[key] *= 1 + 10 * RTOL
    leaf = next(iter(flipped["params"]["norms"]))
    flipped["params"]["norms"][leaf][1] *= 1 + 10 * RTOL
    found = script.differences(flipped, golden, rtol=RTOL, atol=ATOL, atol_by_key=RESIDUE)
    assert found[0] == "token ids differ (first at update 1; 3 vs 3 updates)"
    assert any(f.startswith(f"iteration {record.get('iteration', 2)} {key}:") for f in found)
    assert any(f.startswith(f"final params {leaf}:") for f in found)
    assert len(found) == 3
    # A metric made after the recording is not compared; one the recording has and ours lacks still differs.
    newer = json.loads(json.dumps(golden))
    newer["metrics"][0]["sampler/preempted"] = 0
    assert script.differences(newer, golden, added=ADDED) == []
    assert script.differences(golden, newer, added=ADDED) == ["iteration 1 sampler/preempted: None vs 0"]
