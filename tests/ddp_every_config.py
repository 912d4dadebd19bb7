"""Run by tests/test_paper_configs.py under `torch.distributed.run --nproc_per_node 2` (gloo, CPU): every system
and encoder/decoder/annotation choice of test_models.CONFIGS trains two updates under DistributedDataParallel
with find_unused_parameters off (a parameter without a gradient stops such a run at its second update), and the
two processes end with equal parameters. Prints one line per configuration, "ok NAME" on rank 0."""
import hashlib
import os
import sys

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from dtmt_models.training.distributed import Dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_models import CONFIGS, IDS, build, toy_batch  # noqa: E402


def main() -> int:
    group = Dist("cpu")                                   # gloo, as `dtmt train` on the CPU
    rank = group.rank
    torch.set_num_threads(1)
    for (name, options), ident in zip(CONFIGS, IDS):
        model = build(name, **options)                    # same seed on both ranks
        net = DDP(model, find_unused_parameters=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for update in range(2):
            src, src_lengths, prev, tgt = toy_batch(seed=10 * update + rank)   # each rank its own batch
            log_probs = net(src, src_lengths, prev)
            nll = -log_probs.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)[tgt != 0].mean()
            opt.zero_grad()
            nll.backward()
            opt.step()
        digest = hashlib.sha1(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
        digests = group.gather(digest)
        if digests[0] != digests[1]:
            raise SystemExit(f"{ident}: the processes' parameters differ after two updates")
        if rank == 0:
            print(f"ok {ident}", flush=True)
    group.close()                                        # the trainer's shutdown: barrier, then destroy
    return 0


if __name__ == "__main__":
    sys.exit(main())
