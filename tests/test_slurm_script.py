"""`vime slurm`: the host layout, the rendered sbatch script, and endpoints other nodes can reach.

No SLURM needed: these check what the script says (and that bash accepts it), the layout's arithmetic
and its errors, the per-task GPU split of the script's `vime_task` function run under plain bash, how
the whole script ends the job when its steps exit (plain bash again, with fake srun, scancel and
scontrol), and the command line. `tests/test_slurm_cluster.py` runs the scripts on a real cluster.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vime.config import load_config
from vime.slurm.command import main as slurm_main
from vime.slurm.command import write_job
from vime.slurm.layout import SlurmLayoutError, SlurmOptions, plan_layout
from vime.slurm.network import advertised_endpoint
from vime.slurm.render import ScriptPaths, render_script

from conftest import run_env

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "configs" / "demo.yaml"


def render(cfg_overrides: dict | None = None, config: Path = DEMO, **options) -> str:  # type: ignore[no-untyped-def]
    cfg = load_config(config, cfg_overrides or {})
    layout = plan_layout(cfg, SlurmOptions(**options))
    paths = ScriptPaths(Path("/shared/work"), Path("/shared/work/runs/x"), Path("/shared/work/runs/x/config.yaml"), REPO / "bin")
    return render_script(layout, paths, job_name="vime-x", generated_by="vime slurm test", make_demo_model=cfg.make_demo_model,
                         hf_checkpoint=str(cfg.hf_checkpoint), engine_args=cfg.vllm)  # fmt: skip


def bash_accepts(script: str, tmp_path: Path) -> None:
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def sbatch_lines(script: str) -> list[str]:
    return [line for line in script.splitlines() if line.startswith("#SBATCH")]


def srun_block(script: str, role: str) -> str:
    """The srun command (with its continuation lines) that starts `role`."""
    match = re.search(rf"^srun --job-name=vime-{role} .*?&$", script, re.M | re.S)
    assert match, f"no srun line for {role}"
    return match.group(0)


def test_cpu_demo_over_two_nodes(tmp_path: Path) -> None:
    script = render(trainer_nodes=1, rollout_nodes=1)
    bash_accepts(script, tmp_path)
    assert script.startswith("#!/bin/bash\n")
    assert sbatch_lines(script) == [
        "#SBATCH --job-name=vime-x",
        "#SBATCH --chdir=/shared/work",
        "#SBATCH --output=/shared/work/runs/x/slurm/%x-%j.out",
        "#SBATCH --nodes=2",
        "#SBATCH --exclusive",
    ]
    assert 'mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")' in script
    assert 'TRAINER_HOSTS=("${HOSTS[@]:0:1}")' in script and 'ROLLOUT_HOSTS=("${HOSTS[@]:1:1}")' in script
    for role, log in [("broker", "broker.log"), ("trainer", "trainer-%t.log"), ("rollout", "rollout-%t.log"), ("reward", "reward-%t.log")]:
        block = srun_block(script, role)
        assert "--kill-on-bad-exit=1" in block and "--overlap" in block
        assert f'--output="$LOGS/{log}"' in block
        assert "--het-group" not in block
    assert '--broker-bind "tcp://$BIND_HOST:$BROKER_PORT"' in srun_block(script, "broker")
    trainer = srun_block(script, "trainer")
    assert '--weight-bind "tcp://$BIND_HOST:*" --weight-advertise-host "$HEAD_ADDR"' in trainer
    assert "vime_task trainer 0 0 0" in trainer
    # The CPU demo's settings, as `vime run` uses them, and the demo model built in the job.
    assert "VLLM_CPU_OMP_THREADS_BIND" in script and "OMP_NUM_THREADS" in script
    assert '"$VIME_BIN/vime" make-demo-model --out runs/demo-model' in script
    assert "--gres" not in script and "NCCL_SOCKET_IFNAME" not in script


def test_cpu_rollouts_keep_the_configs_kv_cache_size(tmp_path: Path) -> None:
    """vLLM-CPU prefers VLLM_CPU_KVCACHE_SPACE over the engine arguments: set it only where they give no size."""
    sized = render()  # the demo config sets kv_cache_memory_bytes
    assert "VLLM_CPU_KVCACHE_SPACE" not in sized
    config = tmp_path / "demo-default-kv.yaml"
    config.write_text("".join(line for line in DEMO.read_text().splitlines(keepends=True) if "kv_cache_memory_bytes" not in line))
    unsized = render(config=config)
    bash_accepts(unsized, tmp_path)
    assert "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}" in unsized
    assert "vime_task rollout" in srun_block(sized, "rollout")


def test_qwen3_4b_on_four_trainer_and_four_rollout_gpus(tmp_path: Path) -> None:
    config = REPO / "configs" / "slurm-qwen3-4b-grpo.yaml"
    script = render(config=config, trainer_nodes=1, rollout_nodes=1, gpus_per_node=4, interface="ib0", partition="gpu", time="24:00:00")
    bash_accepts(script, tmp_path)
    assert "#SBATCH --gres=gpu:4" in script and "#SBATCH --partition=gpu" in script and "#SBATCH --time=24:00:00" in script
    trainer, rollout = srun_block(script, "trainer"), srun_block(script, "rollout")
    assert "--nodes=1 --ntasks=4 --ntasks-per-node=4" in trainer and "vime_task trainer 0 4 0" in trainer
    assert "--nodes=1 --ntasks=4 --ntasks-per-node=4" in rollout and "vime_task rollout 0 1 1" in rollout
    assert "export NCCL_SOCKET_IFNAME=$VIME_IFACE GLOO_SOCKET_IFNAME=$VIME_IFACE" in script
    assert "BIND_HOST=$VIME_IFACE" in script
    assert "VLLM_CPU_OMP_THREADS_BIND" not in script and "make-demo-model" not in script


def test_colocated_on_one_eight_gpu_node_splits_the_gpus(tmp_path: Path) -> None:
    config = REPO / "configs" / "slurm-qwen3-30b-a3b-8gpu.yaml"
    script = render(config=config, trainer_nodes=1, rollout_nodes=0, gpus_per_node=8)
    bash_accepts(script, tmp_path)
    assert "#SBATCH --nodes=1" in script and "#SBATCH --gres=gpu:8" in script
    assert 'ROLLOUT_HOSTS=("${TRAINER_HOSTS[@]}")' in script
    assert "vime_task trainer 0 4 0" in srun_block(script, "trainer")
    assert "vime_task rollout 4 4 4" in srun_block(script, "rollout")  # GPUs 4-7: tensor parallel 4


def test_heterogeneous_job_has_two_components(tmp_path: Path) -> None:
    script = render(
        {"trainer_world_size": 16, "num_rollout_workers": 4, "vllm": {"tensor_parallel_size": 2}},
        trainer_nodes=2, rollout_nodes=1, gpus_per_node=8, hetjob=True, partition="h100", rollout_partition="l40s",
        sbatch_args=("--constraint=ib",), rollout_sbatch_args=("--mem=0",),
    )  # fmt: skip
    bash_accepts(script, tmp_path)
    lines = sbatch_lines(script)
    split = lines.index("#SBATCH hetjob")
    assert lines[split - 5 : split] == ["#SBATCH --nodes=2", "#SBATCH --exclusive", "#SBATCH --partition=h100", "#SBATCH --gres=gpu:8", "#SBATCH --constraint=ib"]
    assert lines[split + 1 :] == ["#SBATCH --nodes=1", "#SBATCH --exclusive", "#SBATCH --partition=l40s", "#SBATCH --gres=gpu:8", "#SBATCH --mem=0"]
    assert "SLURM_JOB_NODELIST_HET_GROUP_0" in script and "SLURM_JOB_NODELIST_HET_GROUP_1" in script
    assert "--het-group=0" in srun_block(script, "broker") and "--het-group=0" in srun_block(script, "trainer")
    assert "--het-group=1" in srun_block(script, "rollout") and "--het-group=1" in srun_block(script, "reward")
    assert "--ntasks=16 --ntasks-per-node=8" in srun_block(script, "trainer")
    assert "vime_task rollout 0 2 2" in srun_block(script, "rollout")


def test_paths_and_setup_lines_are_kept_intact(tmp_path: Path) -> None:
    cfg = load_config(DEMO, {"run_dir": Path("runs/with space"), "make_demo_model": False})
    options = SlurmOptions(setup=("source /opt/venv/bin/activate", "export HF_HOME=/scratch/hf"))
    layout = plan_layout(cfg, options)
    text, script = write_job(cfg, layout, output=None, generated_by="test", workdir=tmp_path)
    assert script == tmp_path / "runs" / "with space" / "slurm" / "job.sbatch"
    assert os.access(script, os.X_OK)
    bash_accepts(text, tmp_path)
    assert f"RUN_DIR='{tmp_path}/runs/with space'" in text
    assert f'#SBATCH --output="{tmp_path}/runs/with space/slurm/%x-%j.out"' in text  # sbatch reads double quotes
    assert "source /opt/venv/bin/activate\nexport HF_HOME=/scratch/hf\n" in text
    assert (tmp_path / "runs" / "with space" / "config.yaml").read_text() == cfg.to_yaml()
    assert (tmp_path / "runs" / "with space" / "logs").is_dir()


@pytest.mark.parametrize(
    ("overrides", "options", "message"),
    [
        ({"trainer_world_size": 2}, dict(trainer_nodes=4), "trainer_world_size = 2 is fewer than --trainer-nodes 4"),
        ({"trainer_world_size": 6}, dict(trainer_nodes=4), "trainer_world_size = 6 does not split evenly over --trainer-nodes 4"),
        ({"num_rollout_workers": 3}, dict(rollout_nodes=2), "num_rollout_workers = 3 does not split evenly over --rollout-nodes 2"),
        ({"trainer_world_size": 8}, dict(gpus_per_node=4), "8 trainer ranks per node need 8 GPUs but --gpus-per-node is 4"),
        ({"num_rollout_workers": 2, "vllm": {"tensor_parallel_size": 4}}, dict(gpus_per_node=4), "needs 8 GPUs"),
        ({"trainer_world_size": 4, "vllm": {"tensor_parallel_size": 8}}, dict(rollout_nodes=0, gpus_per_node=8), "4 trainer ranks + 1 rollout engines x 8 GPUs"),
        ({}, dict(rollout_partition="l40s"), "--rollout-partition describes the rollout component of a heterogeneous job: add --hetjob"),
        ({}, dict(hetjob=True, rollout_nodes=0), "--hetjob needs rollout nodes of their own"),
        ({}, dict(trainer_nodes=0), "--trainer-nodes must be at least 1"),
    ],
)  # fmt: skip
def test_layouts_that_do_not_fit_name_the_flag(overrides: dict, options: dict, message: str) -> None:
    with pytest.raises(SlurmLayoutError, match=re.escape(message)):
        plan_layout(load_config(DEMO, overrides), SlurmOptions(**options))


def extract_vime_task(script: str) -> str:
    match = re.search(r"^vime_task\(\) \{\n.*?^\}\n", script, re.M | re.S)
    assert match, "no vime_task function in the script"
    return match.group(0)


def run_vime_task(script: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run the script's vime_task under plain bash with SLURM's task variables faked."""
    task_env = {"PATH": os.environ["PATH"], "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                "SLURMD_NODENAME": "gpu07", "SLURM_JOB_ID": "42", "SLURM_STEP_ID": "3", **env}  # fmt: skip
    program = extract_vime_task(script) + 'vime_task "$@"'
    return subprocess.run(["bash", "-c", program, "vime_task", *args], env=task_env, capture_output=True, text=True)


def test_vime_task_gives_each_rollout_engine_its_own_gpus() -> None:
    script = render(gpus_per_node=8, rollout_nodes=0, trainer_nodes=1)
    # Local task 1 of a node whose GPUs SLURM listed as 8..15; engines of 2 GPUs after 4 trainer GPUs.
    visible = ",".join(str(i) for i in range(8, 16))
    out = run_vime_task(script, "rollout", "4", "2", "2", "bash", "-c", 'echo "gpus=$CUDA_VISIBLE_DEVICES rank=${RANK:-none}"', CUDA_VISIBLE_DEVICES=visible)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0].startswith("vime-slurm: rollout task 5 of 8 on node gpu07")
    assert out.stdout.splitlines()[-1] == "gpus=14,15 rank=none"


def test_vime_task_maps_slurm_variables_for_trainer_ranks() -> None:
    script = render(gpus_per_node=8, rollout_nodes=0, trainer_nodes=1)
    out = run_vime_task(script, "trainer", "0", "4", "0", "bash", "-c", 'echo "$RANK $WORLD_SIZE $LOCAL_RANK $CUDA_VISIBLE_DEVICES"')
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "5 8 1 0,1,2,3"  # every rank of a node sees the trainer's GPUs


def test_vime_task_refuses_a_task_without_enough_gpus() -> None:
    script = render(gpus_per_node=8, rollout_nodes=0, trainer_nodes=1)
    out = run_vime_task(script, "rollout", "4", "4", "4", "true", CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7")
    assert out.returncode == 1
    assert "needs GPUs 8..11 but gpu07 has 8" in out.stderr


# --- The watch loop under plain bash: fake srun/scancel/scontrol/getent, steps that exit on cue --------

FAKE_SRUN = r"""#!/bin/bash
# A step named by --job-name=vime-ROLE sleeps FAKE_<ROLE>'s delay, then exits with its code ("DELAY RC").
role=
for arg; do case $arg in --job-name=vime-*) role=${arg#--job-name=vime-} ;; esac; done
var=FAKE_${role^^}
read -r delay rc <<<"${!var:-0 0}"
echo $$ >"$FAKE_STEPS/$role.pid"
exec >>"$FAKE_STEPS/$role.out" 2>&1  # the real srun writes to --output, not the job's output
sleep "$delay" &
sleeper=$!
trap 'kill $sleeper; echo "$role: SIGTERM"; exit 143' TERM
wait $sleeper
echo "$role: exit $rc"
exit "$rc"
"""

FAKE_SCANCEL = r"""#!/bin/bash
# scancel --signal=TERM JOB: SIGTERM to every fake step still running.
echo "scancel $*" >>"$FAKE_STEPS/scancel.calls"
for pidfile in "$FAKE_STEPS"/*.pid; do kill -TERM "$(cat "$pidfile")" 2>/dev/null; done
exit 0
"""

FAKE_SCONTROL = r"""#!/bin/bash
case "$1 $2" in
  "show hostnames") printf 'node1\nnode2\n' ;;
  "show node") echo "NodeName=$3 Arch=x86_64 NodeAddr=127.0.0.1 NodeHostName=$3 State=ALLOCATED" ;;
  *) echo "fake scontrol: unexpected $*" >&2; exit 1 ;;
esac
"""

FAKE_GETENT = r"""#!/bin/bash
echo "$2        STREAM $2"
"""


def run_job_script(tmp_path: Path, grace_s: int = 10, **steps: str) -> subprocess.CompletedProcess[str]:
    """Run the rendered job script (CPU demo over two nodes) under plain bash, with fake SLURM commands first
    on PATH: each step's srun sleeps, then exits, as `steps` says ("DELAY RC" per role; default "0 0")."""
    cfg = load_config(DEMO, {})
    layout = plan_layout(cfg, SlurmOptions(trainer_nodes=1, rollout_nodes=1, grace_s=grace_s))
    run_dir = tmp_path / "run"
    paths = ScriptPaths(tmp_path, run_dir, run_dir / "config.yaml", tmp_path / "no-bin")
    script = tmp_path / "job.sbatch"
    script.write_text(render_script(layout, paths, job_name="vime-x", generated_by="test", make_demo_model=False))
    fake_bin, fake_steps = tmp_path / "fake-bin", tmp_path / "fake-steps"
    fake_steps.mkdir()
    fake_bin.mkdir()
    for name, text in [("srun", FAKE_SRUN), ("scancel", FAKE_SCANCEL), ("scontrol", FAKE_SCONTROL), ("getent", FAKE_GETENT)]:
        (fake_bin / name).write_text(text)
        (fake_bin / name).chmod(0o755)
    env = {"PATH": f"{fake_bin}{os.pathsep}{os.environ['PATH']}", "HOME": str(tmp_path), "FAKE_STEPS": str(fake_steps),
           "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node[1-2]", **{f"FAKE_{role.upper()}": spec for role, spec in steps.items()}}  # fmt: skip
    # Its own session, so that whatever a broken script leaves running is killed with the group below.
    proc = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
        proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


# The broker exits 0 once the trainer's last step is in; the trainer then takes a moment to exit.
FINISHED_BROKER = dict(reward="0.2 0", rollout="0.2 0", broker="0.5 0")


def test_job_waits_for_the_trainer_after_the_broker_exits_cleanly(tmp_path: Path) -> None:
    result = run_job_script(tmp_path, **FINISHED_BROKER, trainer="2.5 0")
    assert result.returncode == 0, result.stdout
    assert "vime-slurm: training finished" in result.stdout
    assert "before training finished" not in result.stdout and "stopping" not in result.stdout
    assert result.stdout.rstrip().endswith("vime-slurm: job 7 done, exit code 0")
    assert (tmp_path / "fake-steps" / "trainer.out").read_text() == "trainer: exit 0\n"  # not stopped


def test_after_the_broker_exits_one_grace_covers_the_trainer_and_the_rest(tmp_path: Path) -> None:
    """A rollout worker that does not exit gets what is left of the grace the trainer started, not a second one."""
    result = run_job_script(tmp_path, grace_s=6, reward="0.2 0", rollout="60 0", broker="0.5 0", trainer="2.5 0")
    assert result.returncode == 0, result.stdout
    [waited] = re.findall(r"training finished; waiting up to (\d+)s for the other processes", result.stdout)
    assert int(waited) < 6, result.stdout
    assert "vime-slurm: stopping rollout" in result.stdout
    assert (tmp_path / "fake-steps" / "rollout.out").read_text() == "rollout: SIGTERM\n"


def test_job_fails_with_the_trainers_code_when_it_fails_after_the_broker_exits(tmp_path: Path) -> None:
    result = run_job_script(tmp_path, **FINISHED_BROKER, trainer="2.5 3")
    assert result.returncode == 3, result.stdout
    assert "vime-slurm: trainer failed with exit code 3" in result.stdout
    assert "training finished" not in result.stdout


def test_job_fails_when_the_trainer_outlives_the_grace_after_the_broker_exits(tmp_path: Path) -> None:
    result = run_job_script(tmp_path, grace_s=1, **FINISHED_BROKER, trainer="60 0")
    assert result.returncode == 1, result.stdout
    assert "vime-slurm: the broker exited (code 0) but the trainer is still running after 1s" in result.stdout
    assert "vime-slurm: stopping trainer" in result.stdout
    assert (tmp_path / "fake-steps" / "trainer.out").read_text() == "trainer: SIGTERM\n"  # stopped by scancel


def test_job_fails_when_the_broker_fails(tmp_path: Path) -> None:
    result = run_job_script(tmp_path, reward="0.2 0", rollout="0.2 0", broker="0.5 5", trainer="60 0")
    assert result.returncode == 5, result.stdout
    assert "vime-slurm: broker failed with exit code 5" in result.stdout
    assert (tmp_path / "fake-steps" / "trainer.out").read_text() == "trainer: SIGTERM\n"


def test_vime_slurm_prints_the_script_and_reports_bad_layouts(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert slurm_main([str(DEMO), "--run-dir", "run", "--output", "-"]) == 0
    assert capsys.readouterr().out.startswith("#!/bin/bash\n# vime job \"vime-run\", written by: vime slurm ")
    assert slurm_main([str(DEMO), "--run-dir", "run", "--trainer-nodes", "2"]) == 2
    assert "trainer_world_size = 1 is fewer than --trainer-nodes 2" in capsys.readouterr().err
    assert slurm_main([str(DEMO), "--run-dir", "run", "--wait"]) == 2
    assert "--wait needs --submit" in capsys.readouterr().err


def test_vime_slurm_help_lists_layout_and_job_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        slurm_main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--trainer-nodes", "--rollout-nodes", "--gpus-per-node", "--hetjob", "--interface", "--submit", "--rollout-batch-size"):
        assert flag in text


def test_vime_slurm_submit_without_sbatch_says_so(tmp_path: Path) -> None:
    env = run_env(PATH=str(Path(sys.executable).parent))  # no sbatch there
    assert shutil.which("sbatch", path=env["PATH"]) is None
    result = subprocess.run(
        [sys.executable, "-m", "vime.cli", "slurm", str(DEMO), "--run-dir", str(tmp_path / "run"), "--submit"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "sbatch is not on PATH" in result.stderr and str(tmp_path / "run" / "slurm" / "job.sbatch") in result.stderr


@pytest.mark.parametrize(
    ("bound", "host", "expected"),
    [
        ("tcp://127.0.0.1:4000", None, "tcp://127.0.0.1:4000"),
        ("tcp://10.1.2.3:4000", None, "tcp://10.1.2.3:4000"),
        ("tcp://0.0.0.0:4000", "10.9.8.7", "tcp://10.9.8.7:4000"),
        ("tcp://10.1.2.3:4000", "gpu07", "tcp://gpu07:4000"),
        ("tcp://[::]:4000", "fd00::2", "tcp://[fd00::2]:4000"),
        ("ipc:///tmp/weights", "gpu07", "ipc:///tmp/weights"),
    ],
)
def test_advertised_endpoint(bound: str, host: str | None, expected: str) -> None:
    assert advertised_endpoint(bound, host) == expected


def test_a_wildcard_bind_is_advertised_by_host_name() -> None:
    import socket

    assert advertised_endpoint("tcp://0.0.0.0:4000") == f"tcp://{socket.gethostname()}:4000"
