"""The bucket a run checkpoints to, guarded: a bucket deleted while the run trains stops it
with the URL and the store's answer (its steps kept on the node, and where), run as a user
would run their own loop, through the image's entrypoint with two gloo processes."""

from __future__ import annotations

from pathlib import Path

from tests.test_user_code import start
from tests.training_helpers import ROOT, MotoServer, storage_env
from training import contract
from training.checkpoint import run_key

EXAMPLE = ROOT / "examples" / "plain_loop.py"
ENTRYPOINT = ["bash", str(ROOT / "training" / "node" / "entrypoint.sh")]
ENDLESS = 100_000  # steps: the run never ends by itself within a test


def node_env(tmp_path: Path, url: str, endpoint: str, scratch: str = "node", nproc: int = 2,
             extra: dict[str, str] | None = None) -> dict[str, str]:
    command = [str(EXAMPLE), "--steps", str(ENDLESS), "--sleep-ms", "20"]
    return {contract.TRAIN_COMMAND.name: contract.encode_command(command), contract.NPROC_PER_NODE.name: str(nproc),
            contract.CHECKPOINT_DIR.name: str(tmp_path / scratch), contract.CHECKPOINT_URL.name: url,
            contract.CHECKPOINT_EVERY.name: "5", **storage_env(endpoint), **(extra or {})}


def last_line(output: str) -> str:
    return [line for line in output.splitlines() if line.strip()][-1]


def delete_bucket(moto: MotoServer) -> None:
    client = moto.client()
    for key in moto.keys():
        client.delete_object(Bucket=moto.bucket, Key=key)
    client.delete_bucket(Bucket=moto.bucket)


def test_a_bucket_deleted_mid_run_stops_it_with_the_url_the_cause_and_the_kept_steps(moto: MotoServer,
                                                                                    tmp_path: Path) -> None:
    url = f"s3://{moto.bucket}/lost"
    run = start(ENTRYPOINT, node_env(tmp_path, url, moto.url), tmp_path)
    run.wait_for(r"uploaded step-00000010 to s3://")
    delete_bucket(moto)
    assert run.finish() == 2, run.output[-3000:]
    line = last_line(run.output)
    folder = tmp_path / "node" / run_key(url)
    assert line.startswith(f"entrypoint: stopped: checkpoint storage {url}: NoSuchBucket: "), line
    assert f"its checkpoints are kept on this node in {folder} (" in line, line
    kept = line.split(f"{folder} (")[1].split(")")[0].split(", ")
    assert kept and all((folder / name / "manifest-node000.json").is_file() for name in kept), kept
    assert "final step=" not in run.output  # the loop left; the user's own success line never ran
    assert "Traceback" not in run.output and "Exception in thread" not in run.output, run.output[-4000:]
    stopped = int(run.wait_for(r"stopping at step \d+").split("stopping at step ")[1])
    assert stopped < ENDLESS and f"step-{stopped:08d}" in kept  # the step it stopped at is kept too
