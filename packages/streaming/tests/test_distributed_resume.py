"""Two gloo ranks read an epoch; a run killed mid-epoch resumes from its state dict with exactly the tail."""

import json
import os

SCRIPT = r"""
import json, os, sys
import torch.distributed as dist
from torch.utils.data import DataLoader
from smalti.streaming import StreamingDataset
dist.init_process_group("gloo")
rank = dist.get_rank()
local, out, stop_after, state_in = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
ds = StreamingDataset(local=local, batch_size=8, shuffle=True, num_canonical_nodes=2)
if state_in != "-":
    ds.load_state_dict(json.load(open(state_in)))
seen = []
for step, batch in enumerate(DataLoader(ds, batch_size=8, num_workers=1)):
    seen += batch["id"].tolist()
    if step + 1 == stop_after:
        # What a checkpoint would hold: global samples consumed this epoch.
        if rank == 0:
            json.dump(ds.state_dict(num_samples=(step + 1) * 8 * dist.get_world_size()), open(out + ".state", "w"))
        json.dump(seen, open(f"{out}.rank{rank}", "w"))
        dist.barrier()
        os.kill(os.getpid(), 9)  # killed, not a clean exit
json.dump(seen, open(f"{out}.rank{rank}", "w"))
dist.barrier()
dist.destroy_process_group()
"""


def run(script, args, expect_kill=False):
    from smalti.testing.torchrun import run_process_group, torchrun_command

    proc = run_process_group(torchrun_command(2) + [str(script), *map(str, args)], timeout=180,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    if not expect_kill:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_two_rank_kill_and_resume(tmp_path, make_dataset):
    data = make_dataset(tmp_path / "data", n=600)
    script = tmp_path / "reader.py"
    script.write_text(SCRIPT)
    run(script, [data, tmp_path / "full", 0, "-"])
    full = [json.loads((tmp_path / f"full.rank{r}").read_text()) for r in range(2)]
    run(script, [data, tmp_path / "part", 10, "-"], expect_kill=True)
    state = tmp_path / "part.state"
    assert json.loads(state.read_text())["sample_in_epoch"] == 160
    run(script, [data, tmp_path / "rest", 0, state])
    for r in range(2):
        head = json.loads((tmp_path / f"part.rank{r}").read_text())
        tail = json.loads((tmp_path / f"rest.rank{r}").read_text())
        assert head == full[r][:80] and tail == full[r][80:]
