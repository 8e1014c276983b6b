"""The routed MLP of mixture-of-experts models (Qwen3-MoE, OLMoE, Mixtral): router, top-k, grouped experts.

Routing (`route`). The router is a linear layer (E, hidden) giving each token E logits; their softmax in
float32, then the top k by probability with ties broken by expert id (a stable sort of (-p, id): the lower id
wins), then, where the family renormalises (`norm_topk_prob`: Qwen3-MoE configs that say so, Mixtral always),
the k weights divided by their sum. Mixtral's "softmax over the top-k logits" is that same number
(transformers and llama.cpp compute it this way too).

Experts (`Experts`). Each of gate_proj, up_proj (E, I, hidden) and down_proj (E, hidden, I) stays stacked
as the file stores it: an `ExpertStack` of blocks in the file's format (a view of the memory-mapped GGUF
file; an expert no token has chosen was never read and costs no resident memory), or a dense 3-D
parameter (the non-native dense path). A step's (token, expert) pairs are grouped by expert, and each
expert's rows go once through the same row-invariant kernel the dense layers use for that format: on
the PyTorch path below, one `kernels.expert_qmatmul` call per projection for all chosen experts (llama.cpp's
mul_mat_id: x quantized once, the threads split over experts and column panels), whatever the number of
tokens that chose each.

Natively (`MoEMLP.native_args`: a router and experts on native kernels, float32 CPU rows) the whole block
is one call, `moe_mlp` (csrc/moe.cpp): router matmul, softmax (the native exp, as SiLU's) and top-k per
row, the pairs grouped by expert, gate and up in one grouped call on x quantized once, SiLU x up, down,
the weighted sum; the fused decode step (csrc/decode.cpp) calls the same function, so decode and prefill
give a token the same bits. `route` / `Experts.grouped` below are the PyTorch path (no extension, a dense
router or dense experts) and, with `moe_reference`, the definition the native call is tested against.

Exactness. Every kernel computes each output row by a fixed arithmetic of that row alone; the gather and
scatter only move rows; a token's k expert outputs are summed in ascending expert id, starting from zero,
as `moe_reference` does. So a token's output has the same bits whichever other tokens share its experts,
in any batch, chunk or thread count.

`moe_reference` is the pure-PyTorch definition of the block (a loop over tokens): the tests compare the
grouped path with it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kvlm.config import ModelConfig
from kvlm.kernels import ExpertStack, QuantTensor, expert_qmatmul, kernel_path, native, qmatmul
from kvlm.kernels.backend import native_isa
from kvlm.kernels.elementwise import silu_mul
from kvlm.kernels.reference import moe_route_ref


def route(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits (T, E) -> (expert ids (T, k) int64, weights (T, k) float32), by descending
    probability, ties by ascending expert id: the PyTorch path's routing, `reference.moe_route_ref` (the
    definition the native `moe_route` is tested against)."""
    return moe_route_ref(logits, k, renormalize)


def _combine_order(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's k (id, weight) pairs in ascending id: the order its expert outputs are summed in."""
    ids, perm = torch.sort(ids, dim=-1)
    return ids, weights.gather(1, perm)


_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class Experts(nn.Module):
    """E experts' gate/up/down projections stacked (E, out, in); see the module docstring. Built on the
    meta device as dense parameters; `set` replaces one with the checkpoint's `ExpertStack` or tensor."""

    def __init__(self, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        shapes = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
        for name, shape in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.empty(num_experts, *shape), requires_grad=False))
        self.stacks: dict[str, ExpertStack] = {}  # projections kept in their stored blocks

    def set(self, name: str, t: ExpertStack | torch.Tensor) -> None:
        if isinstance(t, ExpertStack):
            self._parameters.pop(name, None)
            self.stacks[name] = t
        else:
            self.register_parameter(name, nn.Parameter(t, requires_grad=False))

    def weight(self, name: str, e: int) -> QuantTensor | torch.Tensor:
        """Expert e's (out, in) weight of projection `name`."""
        return self.stacks[name].expert(e) if name in self.stacks else getattr(self, name)[e]

    @property
    def nbytes_per_expert(self) -> int:
        """Bytes of weight one expert's three projections read."""
        total = 0
        for name in _PROJECTIONS:
            if name in self.stacks:
                total += self.stacks[name].nbytes // self.num_experts
            else:
                p = getattr(self, name)
                total += p[0].numel() * p.element_size()
        return total

    def forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e on rows x (M, hidden) -> (M, hidden): down(silu(gate x) * up x)."""
        g, u = (_mm(x, self.weight(n, e)) for n in ("gate_proj", "up_proj"))
        return _mm(silu_mul(torch.cat((g, u), dim=-1)), self.weight("down_proj", e))

    def grouped(self, x: torch.Tensor, counts: list[int], counts_t: torch.Tensor | None = None) -> torch.Tensor:
        """Rows x (R, hidden) grouped by expert in ascending id, counts[e] rows of expert e -> (R, hidden),
        each group through its expert. Stored blocks: one `expert_qmatmul` per projection (each row the
        bits of `forward` on its expert alone; `counts_t`: the counts as an (E,) int64 tensor, if the caller
        has it); dense parameters: `forward` per expert."""
        if len(self.stacks) == len(_PROJECTIONS):
            g, u = (expert_qmatmul(x, self.stacks[n], counts, counts_t) for n in ("gate_proj", "up_proj"))
            return expert_qmatmul(silu_mul(torch.cat((g, u), dim=-1)), self.stacks["down_proj"], counts, counts_t)
        out = torch.empty_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n:
                out[start:start + n] = self.forward(e, x[start:start + n]).to(x.dtype)
                start += n
        return out

    def extra_repr(self) -> str:
        kinds = ", ".join(f"{n}:{self.stacks[n].qtype.name}" if n in self.stacks else f"{n}:dense"
                          for n in _PROJECTIONS)
        return f"experts={self.num_experts}, hidden={self.hidden}, inter={self.inter}, {kinds}"


def _mm(x: torch.Tensor, w: QuantTensor | torch.Tensor) -> torch.Tensor:
    return qmatmul(x, w) if isinstance(w, QuantTensor) else x @ w.T


class Router(nn.Linear):
    """The router's (E, hidden) linear layer, without nn.Linear's random init (the weights are loaded)."""

    def reset_parameters(self) -> None:
        pass


class MoEMLP(nn.Module):
    """Router `gate` (a linear layer, E x hidden) and `experts`. forward: (T, hidden) -> (T, hidden)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.top_k, self.renormalize = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = Router(h, config.num_experts, bias=False)
        self.experts = Experts(config.num_experts, h, config.moe_intermediate_size)
        # Expert-load counters, always kept (E + 2 integer adds a step; the native call and the fused decode
        # step add to this tensor in place): rows routed to each expert, calls (steps), and over the calls the
        # experts touched, which the step reads. `count_expert_load` zeroes them. On the CPU even while the
        # engine builds the model on the meta device.
        self.stats = torch.zeros(config.num_experts + 2, dtype=torch.int64, device="cpu")

    @property
    def load(self) -> torch.Tensor:
        """(E,) int64: rows routed to each expert since the counters were zeroed."""
        return self.stats[:-2]

    @property
    def calls(self) -> int:
        return int(self.stats[-2])

    @property
    def touched(self) -> int:
        return int(self.stats[-1])

    def native_args(self) -> tuple | None:
        """The weights as `moe_mlp` (csrc/moe.cpp) takes them: (router blocks, router type, gate, up and down
        stacks, their types), or None where the block cannot run natively (a dense router or dense experts,
        a format without a native kernel, the extension missing)."""
        g, ex = self.gate, self.experts
        # the router as a QuantLinear (model/quant_layers.py, which imports this module: read by its fields)
        parts, dense = getattr(g, "parts", None), getattr(g, "dense_t", None)
        if native_isa() is None or len(ex.stacks) != len(_PROJECTIONS) or parts is None or dense is None:
            return None
        if len(parts) != 1 or g.bias is not None or any(d is not None for d in dense):
            return None
        stacks = [ex.stacks[n] for n in _PROJECTIONS]
        if any(kernel_path(t.qtype) == "reference" for t in [parts[0], *stacks]) \
                or any(t.data.stride(2) != 1 for t in stacks) or parts[0].data.stride(1) != 1:
            return None
        return (parts[0].data, int(parts[0].qtype), *(t.data for t in stacks), [int(t.qtype) for t in stacks])

    def forward(self, x: torch.Tensor, lora: object = None) -> torch.Tensor:
        # lora: the decoder layer passes its step's LoRARows to every MLP; the engine refuses adapters on MoE
        # models (Engine.load_lora), so it is always None here.
        args = self.native_args() if native_isa(x) is not None and x.dim() == 2 else None
        if args is not None:
            x2 = x.contiguous()
            out = torch.empty_like(x2)
            native.ops().moe_mlp(x2, *args, self.top_k, self.renormalize, native.isa_id(native_isa()),
                                 native.int8_activations(), self.stats, out)
            return out
        T, k = x.shape[0], self.top_k
        ids, weights = route(self.gate(x), k, self.renormalize)
        ids, weights = _combine_order(ids, weights)
        flat = ids.reshape(-1)  # (T * k,): pair j is token j // k's (j % k)-th expert by id
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert
        counts_t = torch.bincount(flat, minlength=self.experts.num_experts)
        E = self.experts.num_experts
        self.stats[:E] += counts_t.cpu()
        self.stats[E:] += torch.tensor([1, int((counts_t > 0).sum())])
        counts = counts_t.tolist()
        y = x.new_empty(T * k, x.shape[1])
        y[order] = self.experts.grouped(x[order // k], counts, counts_t).to(y.dtype)
        y = y.view(T, k, -1) * weights.to(y.dtype).unsqueeze(-1)
        out = torch.zeros_like(x)
        for r in range(k):  # ascending expert id, from zero: the same additions for a token in any batch
            out = out + y[:, r]
        return out


def count_expert_load(model: nn.Module) -> list[MoEMLP]:
    """Zero the expert-load counters of every routed layer of `model` (in place: the fused decode step holds
    pointers to them); returns the layers."""
    layers = [m for m in model.modules() if isinstance(m, MoEMLP)]
    for m in layers:
        m.stats.zero_()
    return layers


def moe_reference(x: torch.Tensor, router: torch.Tensor, gate: list[torch.Tensor], up: list[torch.Tensor],
                  down: list[torch.Tensor], k: int, renormalize: bool,
                  matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """The definition, one token at a time: route, then sum weight x down(silu(gate x) * up x) over the
    token's experts in ascending id. Weights are dense (out, in) float tensors per expert; `matmul(x, w)`
    defaults to x @ w.T (pass a quantized-kernel reference to define a format's numerics)."""
    mm = matmul or (lambda a, w: a @ w.T)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        xt = x[t:t + 1]
        ids, w = route(mm(xt, router), k, renormalize)
        ids, w = _combine_order(ids, w)
        acc = torch.zeros_like(xt)
        for e, we in zip(ids[0].tolist(), w[0]):
            g, u = mm(xt, gate[e]), mm(xt, up[e])
            acc = acc + mm(torch.nn.functional.silu(g) * u, down[e]) * we
        out[t] = acc[0]
    return out
