"""The Cloud TPU scripts, checked through their dry runs (the exact gcloud commands they would run)."""

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "tpu_scripts"
NAMES = ["create", "setup", "launch", "launch_two_jobs", "logs", "copy", "stop", "delete"]


def dry(script, *args):
    out = subprocess.run(
        ["bash", str(SCRIPTS / f"{script}.sh"), "--dry-run", *args],
        capture_output=True, text=True, check=True, env={"PATH": "/usr/bin:/bin"},
    )
    return [line[2:] for line in out.stdout.splitlines() if line.startswith("+ ")]


def test_v5e_8_single_host_lifecycle():
    scope = "--zone=us-west4-a --project=my-proj"
    flags = ["--name", "rl", "--zone", "us-west4-a", "--project", "my-proj", "--accelerator", "v5litepod-8"]
    assert dry("create", *flags) == [
        f"gcloud compute tpus tpu-vm create rl {scope} --accelerator-type=v5litepod-8 --version=v2-alpha-tpuv5-lite"
    ]
    [scp, pip] = dry("setup", *flags)
    assert scp.startswith("gcloud compute tpus tpu-vm scp --recurse ")
    assert scp.endswith(f"rl:\\~/jgrpo {scope} --worker=all")
    assert pip.startswith(f"gcloud compute tpus tpu-vm ssh rl {scope} --worker=all --command=")
    assert "pip\\ install\\ -q\\ -e\\ \\'.\\[tpu\\]\\'" in pip
    assert "apt-get\\ install\\ -y\\ -qq\\ bubblewrap" in pip  # the python tool's sandbox
    [launch] = dry("launch", "configs/quickstart.yaml", "run.output_dir=gs://bucket/run1", *flags)
    assert launch.startswith(f"gcloud compute tpus tpu-vm ssh rl {scope} --worker=all --command=")
    assert "python3\\ -m\\ jgrpo.train\\ configs/quickstart.yaml\\ run.output_dir=gs://bucket/run1" in launch
    assert dry("logs", *flags) == [
        f"gcloud compute tpus tpu-vm ssh rl {scope} --worker=0 --command=tail\\ -n\\ 100\\ -f\\ ~/jgrpo-train.log"
    ]
    assert dry("copy", "runs/a", "/tmp/x", *flags) == [
        f"gcloud compute tpus tpu-vm scp --recurse rl:\\~/jgrpo/runs/a /tmp/x {scope} --worker=0"
    ]
    [stop] = dry("stop", *flags)
    assert "pkill\\ -TERM" in stop and "--worker=all" in stop
    assert dry("delete", *flags) == [f"gcloud compute tpus tpu-vm delete rl {scope} --quiet"]


def test_two_jobs_on_two_slices():
    describe, trainer, rollout = dry("launch_two_jobs", "--trainer", "tr", "--rollout", "ro", "--zone", "z",
                                     "configs/x.yaml", "run.output_dir=gs://b/r")
    assert describe == "gcloud compute tpus tpu-vm describe tr --zone=z --format=value\\(networkEndpoints\\[0\\]" \
                       ".ipAddress\\)"
    for line, slice_name, role, log in ((trainer, "tr", "trainer", "jgrpo-train"), (rollout, "ro", "rollout",
                                                                                    "jgrpo-rollout")):
        assert line.startswith(f"gcloud compute tpus tpu-vm ssh {slice_name} --zone=z --worker=all --command=")
        assert (f"jgrpo.train\\ configs/x.yaml\\ run.output_dir=gs://b/r\\ rollout.role={role}\\ "
                "rollout.endpoint=TRAINER_WORKER0_IP:8477\\ \\>\\ ~/" + log) in line
    out = subprocess.run(["bash", str(SCRIPTS / "launch_two_jobs.sh"), "--dry-run", "configs/x.yaml"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "--trainer NAME and --rollout NAME are required" in out.stderr


def test_v5p_32_pod_queued_spot():
    flags = ["--name", "pod", "--zone", "us-east5-a", "--accelerator", "v5p-32"]
    assert dry("create", "--queued", "--spot", *flags) == [
        "gcloud compute tpus queued-resources create pod-qr --zone=us-east5-a --node-id=pod "
        "--accelerator-type=v5p-32 --runtime-version=v2-alpha-tpuv5 --spot"
    ]
    assert dry("delete", "--queued", *flags) == [
        "gcloud compute tpus queued-resources delete pod-qr --zone=us-east5-a --force --quiet"
    ]
    assert dry("create", "--accelerator", "v6e-16")[0].endswith("--accelerator-type=v6e-16 --version=v2-alpha-tpuv6e")


@pytest.mark.parametrize("name", NAMES)
def test_help_and_bad_input(name):
    out = subprocess.run(["bash", str(SCRIPTS / f"{name}.sh"), "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith(f"usage: tpu_scripts/{name}.sh") and "--dry-run" in out.stdout
    bad = subprocess.run(
        ["bash", str(SCRIPTS / f"{name}.sh"), "--dry-run", "--bogus", "x"], capture_output=True, text=True
    )
    if name not in ("launch", "launch_two_jobs", "copy"):  # those take free positional arguments
        assert bad.returncode != 0 and "error:" in bad.stderr


def test_unknown_accelerator_fails():
    out = subprocess.run(["bash", str(SCRIPTS / "create.sh"), "--dry-run", "--accelerator", "h100-8"],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "unknown accelerator type 'h100-8'" in out.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed (.ci/install installs it)")
def test_shellcheck_clean():
    out = subprocess.run(["shellcheck", "-x", *[str(p) for p in sorted(SCRIPTS.glob("*.sh"))]],
                         capture_output=True, text=True, cwd=SCRIPTS)
    assert out.returncode == 0, out.stdout
