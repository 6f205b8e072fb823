"""`cpn worker` refuses a bad launch at once, with one line, before any process group."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from cpn.contracts import load_job
from cpn.listen_ports import free_port
from cpn.scheduler import SolverSettings, plan_job
from tests.factories import job, site, topology
from tests.unit.test_checkpoint_store import write_checkpoint


def worker(
    tmp: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"}
    }
    return subprocess.run(
        [sys.executable, "-m", "cpn", "worker", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**base, **(env or {})},
        check=False,
    )


def files(tmp: Path, dp: int = 2, tp: int = 1, pp: int = 2) -> tuple[str, str]:
    spec = job(dp, tp, pp, layers=4, hidden=64, heads=4, seq_len=16, vocab=256)
    plan = plan_job(
        topology([site("a", nodes=1, gpus=8)], []), spec, settings=SolverSettings(time_limit=2)
    )
    (tmp / "plan.json").write_text(plan.model_dump_json())
    (tmp / "job.yaml").write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    return str(tmp / "plan.json"), str(tmp / "job.yaml")


def one_line_error(out: subprocess.CompletedProcess[str]) -> str:
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    return lines[0]


def test_bad_launches(tmp_path: Path) -> None:
    plan, spec = files(tmp_path)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", "WORLD_SIZE": "4"}
    start = time.monotonic()
    msg = one_line_error(
        worker(
            tmp_path, "--plan", plan, "--job", spec, "--rank", "0", env={**env, "WORLD_SIZE": "3"}
        )
    )
    assert "WORLD_SIZE: 3, but the plan has dp×tp×pp = 4 workers" in msg
    assert time.monotonic() - start < 30, "no process group was waited on"
    assert "MASTER_ADDR: not set" in one_line_error(
        worker(tmp_path, "--plan", plan, "--job", spec, "--rank", "0")
    )
    assert "no complete checkpoint" in one_line_error(
        worker(
            tmp_path,
            "--plan",
            plan,
            "--job",
            spec,
            "--rank",
            "1",
            "--resume",
            "--checkpoint-store",
            str(tmp_path / "none"),
            env=env,
        )
    )
    assert "--schedule: 'zigzag'" in one_line_error(
        worker(
            tmp_path, "--plan", plan, "--job", spec, "--rank", "1", "--schedule", "zigzag", env=env
        )
    )
    (tmp_path / "broken.json").write_text("{not json")
    assert "not valid JSON at line 1" in one_line_error(
        worker(tmp_path, "--plan", str(tmp_path / "broken.json"), "--job", spec, env=env)
    )
    other = job(4, 1, 1, layers=4, hidden=64, heads=4, seq_len=16)
    (tmp_path / "other.yaml").write_text(yaml.safe_dump(other.model_dump(mode="json")))
    assert "binding.job_digest" in one_line_error(
        worker(
            tmp_path, "--plan", plan, "--job", str(tmp_path / "other.yaml"), "--rank", "0", env=env
        )
    )
    assert "--ranks: '3,3'" in one_line_error(
        cli(
            "launch",
            "--plan",
            plan,
            "--job",
            spec,
            "--ranks",
            "3,3",
            "--rdzv-endpoint",
            "127.0.0.1:0",
        )
    )


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cpn", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def edited_plan(tmp: Path, name: str, edit: Callable[[dict[str, Any]], None]) -> str:
    plan, _ = files(tmp)
    doc = json.loads(Path(plan).read_text())
    edit(doc)
    (tmp / name).write_text(json.dumps(doc))
    return str(tmp / name)


def _share_a_gpu(doc: dict[str, Any]) -> None:
    first, second = doc["shards"][0], doc["shards"][1]
    second.update(site=first["site"], node=first["node"], gpus=first["gpus"])


def _unknown_site(doc: dict[str, Any]) -> None:
    doc["shards"][0]["site"] = "atlantis"


def _drop_a_shard(doc: dict[str, Any]) -> None:
    doc["shards"].pop()


def _unbind(doc: dict[str, Any]) -> None:
    doc.pop("binding")


def _micro_batches(doc: dict[str, Any]) -> None:
    doc["micro_batches"] = 1_000_000_000


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_share_a_gpu, "both use GPU"),
        (_unknown_site, "site 'atlantis', which is not in the topology"),
        (_drop_a_shard, "need exactly one entry per (replica, stage)"),
        (_unbind, "binding: missing"),
        (_micro_batches, "micro_batches: 1000000000, but the job's batch gives"),
    ],
    ids=["shared-gpu", "unknown-site", "missing-shard", "unbound", "micro-batches"],
)
def test_cpn_train_refuses_a_bad_plan_with_one_line(
    tmp_path: Path, edit: Callable[[dict[str, Any]], None], message: str
) -> None:
    _, spec = files(tmp_path)
    plan = edited_plan(tmp_path, "bad.json", edit)
    line = one_line_error(cli("train", "--plan", plan, "--job", spec, "--workdir", str(tmp_path)))
    assert message in line
    assert not list(tmp_path.glob("rank-*")), "no worker was started"


def test_cpn_train_refuses_a_plan_for_another_version_of_the_job(tmp_path: Path) -> None:
    plan, spec = files(tmp_path)
    doc = yaml.safe_load(Path(spec).read_text())
    doc["compression"] = {"wan": "topk", "density": 0.01}  # a dense plan for a top-k job
    (tmp_path / "topk.yaml").write_text(yaml.safe_dump(doc))
    line = one_line_error(cli("train", "--plan", plan, "--job", str(tmp_path / "topk.yaml")))
    assert "binding.job_digest: the plan was made for another version of job" in line


def test_a_worker_whose_peers_never_join_says_so_in_one_line(tmp_path: Path) -> None:
    """Outside review: torch's DistStoreError escaped as a 54-line traceback."""
    plan, spec = files(tmp_path, dp=2, tp=1, pp=1)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    out = worker(tmp_path, "--plan", plan, "--job", spec, "--rank", "0", "--timeout", "2", env=env)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    [line] = [x for x in out.stderr.splitlines() if x.startswith("error: ")]
    assert line.startswith("error: joining the process group failed at step 0 among ranks [0, 1]")
    assert "1/2 clients joined" in line


def test_metrics_to_stdout_one_json_line_per_step(tmp_path: Path) -> None:
    plan, spec = files(tmp_path, dp=1, tp=1, pp=1)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "1"}
    out = worker(
        tmp_path, "--plan", plan, "--job", spec, "--rank", "0", "--metrics", "-",
        "--stop-after", "3", env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(
        r["loss"] > 0 and set(r["bytes"]) == {"intra_node", "intra_site", "wan"} for r in records
    )
    assert {"compute", "pipeline", "dp_sync", "step"} == set(records[0]["seconds"])


@pytest.mark.parametrize(("url", "package"), [("s3://bucket/ckpt", "s3fs"), ("gs://b/c", "gcsfs")])
def test_a_store_whose_filesystem_is_not_installed_is_refused_before_any_worker(
    tmp_path: Path, url: str, package: str
) -> None:
    """Not only on --resume: the launcher's workers would otherwise fail one by one."""
    assert importlib.util.find_spec(package) is None, f"{package} is installed here"
    plan, spec = files(tmp_path)
    work = tmp_path / "work"
    store = ["--checkpoint-store", url, "--checkpoint-every", "1"]
    start = time.monotonic()
    line = one_line_error(
        cli("train", "--plan", plan, "--job", spec, *store, "--workdir", str(work))
    )
    assert line.startswith(f"error: --checkpoint-store: {url}: ") and package in line
    out = cli("launch", "--plan", plan, "--job", spec, *store, "--workdir", str(work),
              "--ranks", "0,1", "--rdzv-endpoint", "127.0.0.1:0")  # fmt: skip
    assert one_line_error(out) == line
    assert time.monotonic() - start < 60, "no worker was waited on"
    assert not work.exists(), "no worker was started"


def test_a_rendezvous_port_taken_on_the_host_is_one_line_and_a_result(tmp_path: Path) -> None:
    """The node that serves the rendezvous finds its port taken: no worker starts, one
    line names the endpoint and the cause, and result.json says so (it said ok)."""
    plan, spec = files(tmp_path)
    work = tmp_path / "work"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = cli("launch", "--plan", plan, "--job", spec, "--ranks", "0,1,2,3",
                  "--rdzv-endpoint", f"127.0.0.1:{port}", "--workdir", str(work))  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    prefix = f"error: rendezvous failed (serving 127.0.0.1:{port}), no worker started: "
    assert lines[0].startswith(prefix) and "address already in use" in lines[0], lines[0]
    result = json.loads((work / "result.json").read_text())
    assert result == {"ok": False, "error": lines[0].removeprefix("error: ")}
    assert not list(work.glob("rank-*.log")), "no worker was started"


def _finished_run(tmp: Path, step: int) -> tuple[str, str, str]:
    """A plan, its job (10 steps) and a store whose last checkpoint is at `step`."""
    plan, spec = files(tmp)
    store = write_checkpoint(tmp / "store", step, load_job(spec))
    return plan, spec, store.url


def test_resuming_a_finished_run_says_so_and_starts_nothing(tmp_path: Path) -> None:
    plan, spec, store = _finished_run(tmp_path, 10)
    work = tmp_path / "work"
    base = ["--plan", plan, "--job", spec, "--resume", "--checkpoint-store", store]
    out = cli("train", *base, "--workdir", str(work))
    assert out.returncode == 0, out.stderr
    want = f"nothing to train: already trained to step 10 of 10 (checkpoint step 10 in {store})"
    assert out.stderr.strip() == want
    assert not list(work.glob("rank-*")), "no worker was started"
    # What a site agent runs: the same line, and a result that says it is done.
    out = cli("launch", *base, "--ranks", "0,1", "--rdzv-endpoint", "127.0.0.1:0",
              "--workdir", str(work))  # fmt: skip
    assert (out.returncode, out.stderr.strip()) == (0, want)
    assert json.loads((work / "result.json").read_text()) == {"ok": True, "trained": 0}
    assert not list(work.glob("rank-*"))
    # Named by its step directory, without a store of the run's own (outside review: the
    # line said "in None").
    step = f"{store}/step-00000010"
    out = cli("train", "--plan", plan, "--job", spec, "--resume-from", step)
    assert (out.returncode, out.stderr.strip()) == (
        0,
        f"nothing to train: already trained to step 10 of 10 (checkpoint {step})",
    )
    # SIGUSR2 asks for a checkpoint: without a store it is refused, not left to end the
    # launch (the signal's default action).
    out = cli("launch", "--plan", plan, "--job", spec, "--ranks", "0,1", "--rdzv-endpoint",
              "127.0.0.1:0", "--workdir", str(work), "--checkpoint-on-usr2")  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == "error: --checkpoint-on-usr2: needs --checkpoint-store"


def test_resuming_past_stop_after_says_so(tmp_path: Path) -> None:
    plan, spec, store = _finished_run(tmp_path, 6)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", "WORLD_SIZE": "4"}
    out = worker(
        tmp_path, "--plan", plan, "--job", spec, "--rank", "1", "--resume",
        "--checkpoint-store", store, "--stop-after", "6", env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip() == (
        "nothing to train: already trained to step 6 of 10, --stop-after is 6 "
        f"(checkpoint step 6 in {store})"
    )


def test_a_wrong_file_or_environment_is_reported_before_torch_is_imported(
    tmp_path: Path,
) -> None:
    # torch takes seconds to import on a GPU host: what the worker can check without it
    # (its files, the launcher's environment) is checked first.
    plan, spec = files(tmp_path)
    probe = (
        "import sys\n"
        "from cpn.cli import main\n"
        "sys.argv = ['cpn', 'worker', *sys.argv[1:]]\n"
        "try:\n"
        "    main()\n"
        "finally:\n"
        "    print('torch imported:', 'torch' in sys.modules, file=sys.stderr)\n"
    )
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", "WORLD_SIZE": "4"}
    cases = [
        (["--plan", str(tmp_path / "missing.json"), "--job", spec], env, "no such file"),
        (["--plan", plan, "--job", str(tmp_path / "missing.yaml")], env, "no such file"),
        (["--plan", plan, "--job", spec], {}, "MASTER_ADDR: not set"),
        (["--plan", plan, "--job", spec], {**env, "WORLD_SIZE": "four"}, "not an integer"),
    ]
    base = {k: v for k, v in os.environ.items() if k not in {*env, "RANK"}}
    for args, extra, expected in cases:
        out = subprocess.run(
            [sys.executable, "-c", probe, *args],
            capture_output=True,
            text=True,
            timeout=60,
            env={**base, **extra},
            check=False,
        )
        assert out.returncode == 2, out.stderr
        assert expected in out.stderr, out.stderr
        assert "torch imported: False" in out.stderr, args
