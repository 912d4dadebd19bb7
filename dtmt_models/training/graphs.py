"""Training updates replayed as CUDA graphs (`dtmt train --cuda-graphs`; issue 73 item 1).

An update of a recurrent system launches thousands of small kernels (a GEMM and a pointwise kernel per sub-cell and
step, forward and backward) and on a GPU the host cannot launch them as fast as the device runs them. A CUDA graph
records the whole update once (forward, backward, gradient clipping, the Adam step) and replays it with one launch.

A graph replays fixed shapes at fixed addresses, so:
  - each batch is padded to a bucket shape (padded_shape: source and target lengths up to a multiple of
    `length_step`, rows up to a multiple of `batch_step`) and copied into that bucket's input tensors. A padding
    row has a one-token source of EOS and a target of PAD only: it adds nothing to the loss, to the token count or
    to any gradient (tests/test_graphs.py checks every system), as padding positions add nothing today;
  - a bucket's first batch is an eager update (on a side stream, as torch.cuda.graph requires: it makes the lazy
    initialisations, cuBLAS's workspaces, the optimizer's state); its second is captured and then replayed, and so
    is every later one. Every batch is a real update: none is spent on a warm-up;
  - nothing is read on the host during a capture (dtmt_kernels.functional.host_reads_allowed: the input checks are
    device asserts, counts stay tensors); the learning rate is a tensor on the device that the schedule fills
    before each update (torch's LRScheduler fills a tensor lr in place), and Adam runs fused with `capturable`
    (its step counts on the device);
  - every graph draws on one memory pool: a replay writes all it later reads (activations, gradients, the loss)
    before reading it, and reads nothing a capture made except through the tensors outside the pool (parameters,
    optimizer state, the bucket's inputs and outputs, the learning rate, the random generator's state). The pool is
    so about the size of the largest bucket's update, not the sum; `summary()` reports it. Past `max_graphs`
    captures, or once the pool holds more than `max_memory_fraction` of the device's memory, new buckets stay
    eager.
  - a module's cached tensor (the positional-encoding table, grown on demand) that a graph read when captured is
    kept alive with that graph: a longer batch later makes a new table (on its eager first update), and the old
    one's memory must not be handed to anything else while a graph still reads it;
  - dropout draws from torch's CUDA generator, which a graph advances at each replay: the masks differ from an
    eager run's (they come from other offsets of the stream), not their distribution.

On the CPU there is no graph: `StandInCapture` (tests only) keeps the captured function and runs it again at each
replay with the host reads forbidden as a capture forbids them, so that the bucketing, the padding, the static
inputs and the capture-safe code path are all checked without a GPU.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from dtmt_kernels.ops._host_reads import as_captured
from dtmt_models.data.vocabulary import EOS, PAD
from dtmt_models.errors import one_line

Shape = Tuple[int, int, int]   # (rows B, source length S, target length T) of a padded batch
Body = Callable[[Tensor, Tensor, Tensor, Tensor], Tuple[Tensor, Tensor, Tensor]]


class CaptureFailed(RuntimeError):
    """An update that could not be captured as a CUDA graph: the run stops (the stream may be unusable), in one line
    naming the batch's shape and --no-cuda-graphs; the last checkpoint written stands."""


@dataclasses.dataclass(frozen=True)
class GraphOptions:
    """How batches are bucketed and how many graphs are kept (benchmarks set them; `dtmt train` uses the
    defaults). On the Bible corpus at 2,000-8,000 tokens a batch, lengths in 8s and rows in 16s give 36-38 buckets an
    epoch, the padded tokens 1.15-1.26x the collated ones (16 / 16: 24-30 buckets, 1.28-1.41x; `bench_train.py
    --buckets`, docs/design/gpu.md)."""
    length_step: int = 8              # padded source and target lengths: multiples of this
    batch_step: int = 16              # padded rows: multiples of this
    max_graphs: int = 64              # captures kept; a bucket past them runs eagerly
    max_memory_fraction: float = 0.5  # of the device's memory the graphs' pool may hold before captures stop

    def __post_init__(self) -> None:
        # (a step of 0 divided by zero, a negative one made buckets smaller than their batches, refused mid-training;
        # a NaN fraction never stopped the captures)
        for name in ("length_step", "batch_step", "max_graphs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GraphOptions.{name} must be an integer >= 1, got {value!r}")
        fraction = self.max_memory_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 < fraction <= 1.0:
            raise ValueError(f"GraphOptions.max_memory_fraction must be a number in (0, 1], got {fraction!r}")


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def padded_shape(B: int, S: int, T: int, options: GraphOptions,
                 most: Tuple[Optional[int], Optional[int]] = (None, None)) -> Shape:
    """The bucket of a batch of B rows, source length S and target length T (with EOS); its lengths not rounded up
    past `most`, the model's source and target positions (max_source_steps, max_target_steps; None: no bound): a
    transformer of 12 positions refused a batch of 10 padded to 16."""
    s, t = _round_up(S, options.length_step), _round_up(T, options.length_step)
    if most[0] is not None:
        s = max(S, min(s, most[0]))
    if most[1] is not None:
        t = max(T, min(t, most[1]))
    return _round_up(B, options.batch_step), s, t


def pad_batch(src: Tensor, lengths: Tensor, prev: Tensor, target: Tensor, shape: Shape):
    """collate's tensors padded to `shape`: new positions are PAD; a new row's source is one EOS (its length 1: the
    padding id inside a length is refused by check_batch), its target all PAD (it adds nothing to the loss)."""
    B, S, T = shape
    b, s, t = src.shape[0], src.shape[1], prev.shape[1]
    if b > B or s > S or t > T:
        raise ValueError(f"a batch of shape {(b, s, t)} does not fit the bucket {shape}")
    out_src = src.new_full((B, S), PAD)
    out_src[:b, :s] = src
    out_src[b:, 0] = EOS
    out_len = lengths.new_ones(B)
    out_len[:b] = lengths
    out_prev, out_target = prev.new_full((B, T), PAD), target.new_full((B, T), PAD)
    out_prev[:b, :t], out_target[:b, :t] = prev, target
    return out_src, out_len, out_prev, out_target


class CudaCapture:
    """Captures on the current CUDA device, every graph in one memory pool."""

    def __init__(self, device: torch.device):
        if torch.device(device).type != "cuda":   # (torch's own error named a dummy class _graph_pool_handle)
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def warm_up(self, fn: Callable[[], None]) -> None:
        """fn run eagerly on a side stream (what torch.cuda.graph asks of the work before a capture), on the path a
        capture takes (as_captured): the kernels and their lazy set-up the capture will meet."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), as_captured():
            fn()
        torch.cuda.current_stream(self.device).wait_stream(side)

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            fn()
        return graph.replay

    def pool_bytes(self) -> int:
        """The bytes the graphs' pool holds (the caching allocator's reserved memory of that pool)."""
        stats = [s for s in torch.cuda.memory.memory_snapshot() if tuple(s.get("segment_pool_id", ())) ==
                 tuple(self.pool)]
        return sum(s["total_size"] for s in stats)

    def memory_bytes(self) -> int:
        return torch.cuda.get_device_properties(self.device).total_memory


class StandInCapture:
    """For tests without a GPU: a capture keeps the function, a replay runs it with host reads forbidden (as
    during a real capture, dtmt_kernels.ops._host_reads). Nothing is recorded: the point is the code path and the
    buffers, not the launches."""

    def warm_up(self, fn: Callable[[], None]) -> None:
        with as_captured():
            fn()

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        def replay():
            with as_captured():
                fn()
        return replay

    def pool_bytes(self) -> int:
        return 0

    def memory_bytes(self) -> int:
        return 1 << 62


class Bucket:
    """A bucket's input and output tensors (outside the graphs' pool: a replay reads and writes them in place), how
    many of its batches have been trained on, the update on them (`run`) and its graph's replay once captured."""

    def __init__(self, padded: Sequence[Tensor], device: torch.device, body: Body):
        self.inputs = [torch.empty_like(t, device=device) for t in padded]   # (each batch is copied in)
        self.outputs = [torch.zeros((), dtype=torch.float64, device=device),   # (losses of any dtype, unrounded)
                        torch.zeros((), dtype=torch.float64, device=device),
                        torch.zeros((), dtype=torch.long, device=device)]
        self.seen = 0
        self.replay: Optional[Callable[[], None]] = None
        self.kept: List[Tensor] = []   # the modules' cached tensors when captured (kept alive with the graph)

        def run():
            for static, value in zip(self.outputs, body(*self.inputs)):
                static.copy_(value if torch.is_tensor(value) else torch.tensor(value))
        self.run = run


class GraphedUpdates:
    """update(batch) -> (loss sum, NLL sum, target tokens) as tensors of this update, the update done by `body`
    (forward, backward, clipping, optimizer step: what Trainer.train_step does eagerly) on the batch padded to its
    bucket, replayed from a CUDA graph from the bucket's second batch on.

    `optimizer`: torch's Adam (build_optimizer's is fused); its learning rate becomes a tensor on `device` and, on a
    CUDA device, its groups `capturable`, here, before the first update (a scheduler made before keeps working: it
    fills the tensor).
    """

    def __init__(self, body: Body, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
                 options: GraphOptions = GraphOptions(), capture=None, log: Callable[[str], None] = print):
        self.body, self.model, self.optimizer, self.device = body, model, optimizer, device
        self.options, self.log = options, log
        self._trained = [p for p in model.parameters() if p.requires_grad]
        self.capturer = capture if capture is not None else CudaCapture(device)
        self.buckets: Dict[Shape, Bucket] = {}
        self.captured = 0
        self.eager_updates = 0    # updates not replayed: first batches of buckets, and buckets past the limits
        self.replayed = 0
        self.capturing_stopped: Optional[str] = None
        for group in optimizer.param_groups:
            if not torch.is_tensor(group["lr"]):
                group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)
            group["capturable"] = device.type == "cuda"   # (its step counts on the device; the CPU has no capture)
            for p in group["params"]:   # step counts an unfused Adam kept on the host before: to the device
                state = optimizer.state.get(p, {})
                if group["capturable"] and torch.is_tensor(state.get("step")) and state["step"].device != p.device:
                    state["step"] = state["step"].to(p.device)
        # (an eager update with a capturable optimizer is deliberate here: torch's warning about it is not for us)
        optimizer._warned_capturable_if_run_uncaptured = True

    def update(self, src: Tensor, lengths: Tensor, prev: Tensor, target: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """One update on a batch as `collate` makes it (on any device: it is padded there, then copied in)."""
        most = getattr(self.model, "max_source_steps", None), getattr(self.model, "max_target_steps", None)
        shape = padded_shape(src.shape[0], src.shape[1], prev.shape[1], self.options, most)
        padded = pad_batch(src, lengths, prev, target, shape)
        bucket = self.buckets.get(shape)
        if bucket is None:
            bucket = self.buckets[shape] = Bucket(padded, self.device, self.body)
        for static, value in zip(bucket.inputs, padded):
            static.copy_(value, non_blocking=True)
        if bucket.replay is not None:
            self._replay(bucket)
        elif bucket.seen == 0:
            self.capturer.warm_up(bucket.run)
            self.eager_updates += 1
        elif not self._may_capture():
            bucket.run()
            self.eager_updates += 1
        else:
            try:
                bucket.replay = self.capturer.capture(bucket.run)
                bucket.kept = cached_tensors(self.model)
            except RuntimeError as exc:   # (what does not capture: a host read, a copy from host memory)
                # a failed capture can leave the stream unusable: the run stops here, last.pt is the previous one
                raise CaptureFailed(f"--cuda-graphs: the update of a batch of shape {shape} could not be captured "
                                    f"as a CUDA graph ({one_line(exc)}); train with --no-cuda-graphs") from exc
            self.captured += 1
            self._replay(bucket)
            self._check_memory()
        bucket.seen += 1
        return tuple(x.clone() for x in bucket.outputs)

    def _replay(self, bucket: Bucket) -> None:
        bucket.replay()
        self.replayed += 1
        # (the optimizer's step hook bumps the parameters' versions in Python, which ran once, at the capture: a
        # decoder built before a replay would not have seen its weights change; engine.forms.weights_kind)
        for p in self._trained:   # (one tensor a call: torch 2.4's takes no list)
            torch.autograd.graph.increment_version(p)

    def _may_capture(self) -> bool:
        if self.capturing_stopped is None and self.captured >= self.options.max_graphs:
            self.capturing_stopped = f"{self.options.max_graphs} graphs captured (GraphOptions.max_graphs)"
            self.log(f"cuda graphs: {self.capturing_stopped}; new batch shapes run eagerly")
        return self.capturing_stopped is None

    def _check_memory(self) -> None:
        held, total = self.capturer.pool_bytes(), self.capturer.memory_bytes()
        if held > self.options.max_memory_fraction * total:
            self.capturing_stopped = (f"the graphs' pool holds {held / 2 ** 30:.1f} GiB, over "
                                      f"{self.options.max_memory_fraction:.0%} of the device's memory")
            self.log(f"cuda graphs: {self.capturing_stopped}; new batch shapes run eagerly")

    def summary(self) -> str:
        total = self.eager_updates + self.replayed
        return (f"cuda graphs: {self.captured} captured for {len(self.buckets)} batch shapes; {self.replayed:,} of "
                f"{total:,} updates replayed; pool {self.capturer.pool_bytes() / 2 ** 20:,.0f} MiB"
                + (f"; captures stopped: {self.capturing_stopped}" if self.capturing_stopped else ""))


def cached_tensors(model: torch.nn.Module) -> List[Tensor]:
    """The tensors held by `model`'s modules as plain attributes (caches such as TokenEmbedding._table; the
    parameters and buffers are the model's own and stay)."""
    return [v for m in model.modules() for v in vars(m).values() if torch.is_tensor(v)]


def float_lrs(state: dict) -> dict:
    """An optimizer state dict with tensor learning rates as floats (what a checkpoint keeps: data on no device)."""
    groups = [dict(g, lr=float(g["lr"])) if torch.is_tensor(g.get("lr")) else g for g in state["param_groups"]]
    return dict(state, param_groups=groups)
