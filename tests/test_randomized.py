"""Randomized differential test: random small models, random call PyTrees, random wrappers.

Each case builds a random stack of one to three blocks (Linear, LayerNorm, Dropout, GELU,
Embedding, scaled_dot_product_attention with and without dropout, residuals, in-place ops on
intermediates, a BatchNorm, a counter and an EMA buffer updated in forward, a projection shared
between blocks and its weight passed in as an argument, a nested inner module, a gate kept by a
save unit, top-k ids replayed by reuse_during_recompute or kept by a save unit), gives every
block a random input PyTree (dicts, OrderedDicts, lists, tuples, namedtuples, dataclasses, a
class registered with optree; the hidden state, the same tensor again, a view of it, int and
bool tensors, a tensor from outside with and without grad, Python ints, floats, strings,
bools, None) and a random output PyTree (the new hidden state, a view of it, its input
returned as it is, an auxiliary loss, ids, non-tensor leaves), and wraps each block at random:
apply_activation_checkpointing with offload off, on, or through a manager of the case's own
(min_bytes 0, 64 or the default, prefetch 0 to 2), apply_recompute_config with save units,
checkpoint, checkpointed, checkpoint_layers, and a nested boundary on the inner module. It then
trains the wrapped model and an unwrapped deep copy for two SGD steps (random sequence
lengths, one or two micro-batches, each with its own backward or one for both, a no-grad
forward first, backward(retain_graph=True) twice, backward(inputs=...),
torch.autograd.grad; the wrapped model unwrapped and wrapped again, or deep-copied, between
the steps; the caller changing an output in place) and compares every output leaf, the loss,
every gradient, every buffer and every parameter with torch.equal in fp32, and that offload
restored what it copied and holds no host buffer after each step.

The generator leaves out the cases docs/limits.md lists as equal only to float rounding
(output discard; a parameter used twice in a call of a layer called several times; an input
used several times in a call and also outside it; a hooked output also used in the layer) and
the two found here (xfails in tests/pytree_ckpt/test_boundary.py), so every case must be exact.
``run_case(seed, exact=False)`` adds output discard and forward hooks and compares to float
tolerance. More seeds: ``python -m tests.test_randomized 0 2000`` (first seed, count).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import random
import warnings
from typing import Any

import optree
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import offload
import pytree_ckpt
from pytree_ckpt import KeptCallables, KeptOps, RecomputeConfig, SaveUnit

B, T, D, VOCAB, HEADS = 2, 4, 8, 11, 2
CASES = 36  # about 8 s on two cores; scripts can run run_case(seed) for many more

Pair = collections.namedtuple("Pair", "a b")


@dataclasses.dataclass
class Box:
    first: Any
    second: Any


class Registered:
    """A container of the caller's own, registered with optree in pytree_ckpt's namespace."""

    def __init__(self, left: Any, right: Any) -> None:
        self.left, self.right = left, right

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Registered) and self.left == other.left
                and self.right == other.right)


optree.register_pytree_node(Registered, lambda r: ((r.left, r.right), None, None),
                            lambda _, children: Registered(*children), namespace="pytree_ckpt")


def topk_ids(h: torch.Tensor, k: int) -> torch.Tensor:
    return h.topk(k, dim=-1).indices


# ---------------------------------------------------------------- templates (PyTrees of slots)

def random_tree(rng: random.Random, slots: list[str]) -> Any:
    """A random container tree whose leaves are ``slots`` (strings), in some order."""
    if len(slots) == 1 and rng.random() < 0.6:
        return slots[0]
    kinds = ["list", "tuple", "dict", "odict"] + (
        ["pair", "box", "registered"] if len(slots) == 2 else [])
    kind = rng.choice(kinds)
    if len(slots) > 2 and rng.random() < 0.5:
        cut = rng.randint(1, len(slots) - 1)
        children = [random_tree(rng, slots[:cut]), random_tree(rng, slots[cut:])]
    else:
        children = [random_tree(rng, [s]) for s in slots]
    if kind == "list":
        return children
    if kind == "tuple":
        return tuple(children)
    if kind == "dict":
        return {f"k{i}": c for i, c in enumerate(children)}
    if kind == "odict":
        return collections.OrderedDict((f"o{i}", c) for i, c in enumerate(children))
    if kind == "pair":
        return Pair(*children)
    if kind == "registered":
        return Registered(*children)
    return Box(*children)


def walk(template: Any, value: Any, found: dict[str, Any]) -> None:
    if isinstance(template, str):
        found.setdefault(template, value)
    elif isinstance(template, Registered):
        assert type(value) is Registered
        walk(template.left, value.left, found)
        walk(template.right, value.right, found)
    elif isinstance(template, dict):
        assert type(value) is type(template) and list(value) == list(template), (template, value)
        for key in template:
            walk(template[key], value[key], found)
    elif isinstance(template, Box):
        assert type(value) is Box
        walk(template.first, value.first, found)
        walk(template.second, value.second, found)
    else:
        assert type(value) is type(template) and len(value) == len(template), (template, value)
        for t, v in zip(template, value):
            walk(t, v, found)


def slots_of(template: Any) -> list[str]:
    found: dict[str, Any] = {}
    walk(template, template, found)
    return list(found)


def build(template: Any, values: dict[str, Any]) -> Any:
    if isinstance(template, str):
        return values[template]
    if isinstance(template, dict):
        return type(template)((k, build(v, values)) for k, v in template.items())
    if isinstance(template, Registered):
        return Registered(build(template.left, values), build(template.right, values))
    if isinstance(template, Box):
        return Box(build(template.first, values), build(template.second, values))
    if isinstance(template, Pair):
        return Pair(*(build(t, values) for t in template))
    return type(template)(build(t, values) for t in template)


# ---------------------------------------------------------------- the model

IN_SLOTS = ["h2", "hv", "ids", "mask", "scale", "name", "flag", "none", "int", "ext", "cst", "w"]
OUT_SLOTS = ["hview", "h_in", "aux", "ids_out", "none", "str", "int", "ext_out", "cst_out",
             "ids_back", "mask_back"]
PLAIN_OPS = ["linear", "norm", "gelu", "drop", "res", "inplace", "attn", "shared", "count",
             "bn", "inner", "gate", "reuse", "fninner", "topk"]
NEEDS = {"emb": "ids", "mask": "mask", "scale": "scale", "ext": "ext", "cst": "cst",
         "view": "hv", "twice": "h2", "tiedw": "w"}


MODULE_OF = {"inplace": "linear", "fninner": "inner", "tiedw": "shared"}


@dataclasses.dataclass
class Plan:
    in_args: list[Any]
    in_kwargs: dict[str, Any]
    out: Any
    ops: list[str]
    view_kind: str
    causal: bool
    attn_dropout: float
    caller_inplace: bool = False


def random_plan(rng: random.Random, *, exact: bool) -> Plan:
    ins = ["h"] + [s for s in IN_SLOTS if rng.random() < 0.3]
    outs = ["h"] + [s for s in OUT_SLOTS if rng.random() < 0.25]
    if "ext_out" in outs and "ext" not in ins:
        ins.append("ext")
    if "cst_out" in outs and "cst" not in ins:
        ins.append("cst")
    for back, slot in (("ids_back", "ids"), ("mask_back", "mask")):  # int, bool inputs returned
        if back in outs and slot not in ins:
            ins.append(slot)
    feasible = PLAIN_OPS + 3 * [op for op, need in NEEDS.items() if need in ins]
    if not exact:  # docs/limits.md: output discard is equal to float rounding only
        feasible += ["discard", "chain"]
    ops = [rng.choice(feasible) for _ in range(rng.randint(1, 5))]
    if exact and "h_in" in outs:
        # docs/limits.md: an input used several times in the call and also outside it (the
        # loss reads h_in) is equal to float rounding only.
        ins = [s for s in ins if s not in ("h2", "hv")]
        ops = [op for op in ops if op not in ("twice", "view")] or ["linear"]
    if exact:
        # docs/limits.md: a parameter used several times in a call of a layer called several
        # times (the projection shared between blocks, micro-batches) is equal to float
        # rounding only: each module at most once a call.
        seen: set[str] = set()
        kept = []
        for op in ops:
            if MODULE_OF.get(op, op) not in seen:
                seen.add(MODULE_OF.get(op, op))
                kept.append(op)
        ops = kept
    rng.shuffle(ins)
    cut = rng.randint(0, len(ins))
    args = [random_tree(rng, [s]) for s in ins[:cut]]
    kw_names = ["x", "y", "z", "w", "v", "u", "t", "s", "r", "q", "p", "o"]
    kwargs = {kw_names[i]: random_tree(rng, [s]) for i, s in enumerate(ins[cut:])}
    if len(ins) > 1 and rng.random() < 0.5:  # one structured argument holding everything
        args, kwargs = [random_tree(rng, ins)], {}
    rng.shuffle(outs)
    # The caller changes the output in place (out *= 0.9); docs/limits.md refuses it where
    # outputs view one another, or where the output is an input returned (dropout in eval);
    # eager refuses it where the aux loss saved it. Not after the BatchNorm, whose output is a
    # transposed view: its gradients are off by rounding (xfail in test_boundary.py).
    caller_inplace = (rng.random() < 0.2 and "hview" not in outs and "aux" not in outs
                      and ops[-1] not in ("drop", "view", "scale", "ext", "cst", "twice", "bn"))
    return Plan(args, kwargs, random_tree(rng, outs), ops,
                rng.choice(["slice", "transpose", "expand", "same"]), rng.random() < 0.5,
                rng.choice([0.0, 0.0, 0.25]), caller_inplace)


class Block(nn.Module):
    def __init__(self, plan: Plan, shared: nn.Linear) -> None:
        super().__init__()
        self.plan = plan
        self.plain = False  # the eager twin: output discard and functional boundaries off
        self.lin = nn.Linear(D, D)
        self.lin2 = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)
        self.norm2 = nn.LayerNorm(D)
        self.drop = nn.Dropout(0.3)
        self.emb = nn.Embedding(VOCAB, D)
        self.qkv = nn.Linear(D, 3 * D)
        self.gate_proj = nn.Linear(D, 2)
        self.bn = nn.BatchNorm1d(D)
        self.inner = nn.Sequential(nn.Linear(D, D), nn.Dropout(0.2), nn.GELU())
        self.shared = shared
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))
        self.register_buffer("ema", torch.zeros(D))

    def route(self, h: torch.Tensor) -> torch.Tensor:
        return self.gate_proj(h).softmax(-1)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        plan = self.plan
        got: dict[str, Any] = {}
        walk(plan.in_args, list(args), got)
        walk(plan.in_kwargs, kwargs, got)
        h_in = got["h"]
        h = h_in
        for op in plan.ops:
            if op == "linear":
                h = self.lin(h)
            elif op == "norm":
                h = self.norm(h)
            elif op == "gelu":
                h = F.gelu(h)
            elif op == "drop":
                h = self.drop(h)
            elif op == "res":
                h = h + self.lin2(F.gelu(h))
            elif op == "inplace":
                t = self.lin(h)
                t.mul_(0.5)
                t.relu_()
                h = t + h
            elif op == "attn":
                b, t = h.shape[:2]
                q, k, v = (x.view(b, t, HEADS, D // HEADS).transpose(1, 2)
                           for x in self.qkv(h).chunk(3, -1))
                a = F.scaled_dot_product_attention(
                    q, k, v, is_causal=plan.causal,
                    dropout_p=plan.attn_dropout if self.training else 0.0)
                h = h + a.transpose(1, 2).reshape(b, t, D)
            elif op == "shared":
                h = self.shared(h)
            elif op == "count":
                with torch.no_grad():
                    self.count.add_(1)
                    self.ema.mul_(0.5).add_(h.mean((0, 1)))
                h = h + self.ema
            elif op == "bn":
                h = self.bn(h.transpose(1, 2)).transpose(1, 2)
            elif op == "inner":
                h = self.inner(h)
            elif op == "fninner":  # a functional boundary nested in the block
                h = self.inner(h) if self.plain else pytree_ckpt.checkpoint(self.inner, h)
            elif op == "tiedw":  # the shared projection's weight, passed in as an argument
                h = F.linear(h, got["w"])
            elif op == "gate":
                h = h * self.route(h)[..., :1]
            elif op == "reuse":
                ids = pytree_ckpt.reuse_during_recompute(topk_ids, h.detach(), 2)
                h = h + h.gather(-1, ids).sum(-1, keepdim=True)
            elif op == "topk":  # top-k outside reuse_during_recompute: a save unit keeps it
                ids = h.detach().topk(2, dim=-1).indices
                h = h * 0.5 + h.gather(-1, ids).mean(-1, keepdim=True)
            elif op == "emb":
                h = h + self.emb(got["ids"])
            elif op == "mask":
                h = h.masked_fill(~got["mask"][..., None], 0.0)
            elif op == "scale":
                h = h * got["scale"]
            elif op == "ext":
                h = h + got["ext"]
            elif op == "cst":
                h = h * got["cst"]
            elif op == "view":
                h = h + got["hv"].sum() * 0.1
            elif op == "twice":
                h = h + got["h2"] * 0.5
            elif op == "discard":
                if self.plain:
                    h = self.lin2(self.norm2(h))
                else:
                    ckpt = pytree_ckpt.CheckpointWithoutOutput()
                    n = ckpt.checkpoint(self.norm2, h)
                    o = self.lin2(n)
                    ckpt.discard_output_and_register_recompute(o)
                    h = o
            elif op == "chain":  # two chained discards replayed from one hook
                if self.plain:
                    h = self.lin2(F.gelu(self.norm2(h))) + h
                else:
                    manager = pytree_ckpt.CheckpointWithoutOutputManager()
                    a = manager.checkpoint(self.norm2, h)
                    o = self.lin2(manager.checkpoint(F.gelu, a))
                    manager.discard_all_outputs_and_register_unified_recompute(o)
                    h = o + h
            else:
                raise AssertionError(op)
        values = {"h": h, "hview": h[..., :2], "h_in": h_in, "aux": (h * h).mean(),
                  "ids_out": torch.arange(3), "none": None, "str": "s", "int": 7,
                  "ext_out": got.get("ext"), "cst_out": got.get("cst"),
                  "ids_back": got.get("ids"), "mask_back": got.get("mask")}
        return build(plan.out, values)


def call_values(plan: Plan, h: torch.Tensor, ext: torch.Tensor, cst: torch.Tensor,
                w: torch.Tensor, gen: torch.Generator) -> dict[str, Any]:
    hv = {"slice": lambda: h[:, 1:], "transpose": lambda: h.transpose(1, 2),
          "expand": lambda: h[:, :1].expand(-1, h.shape[1], -1),
          "same": lambda: h}[plan.view_kind]()
    return {"h": h, "h2": h, "hv": hv,
            "ids": torch.randint(0, VOCAB, h.shape[:2], generator=gen),
            "mask": torch.rand(h.shape[:2], generator=gen) > 0.3, "scale": 0.75, "name": "layer",
            "flag": True, "none": None, "int": 3, "ext": ext, "cst": cst, "w": w}


class Model(nn.Module):
    def __init__(self, rng: random.Random, *, exact: bool) -> None:
        super().__init__()
        shared = nn.Linear(D, D)
        plans = [random_plan(rng, exact=exact) for _ in range(rng.randint(1, 3))]
        if exact and any("w" in slots_of((p.in_args, p.in_kwargs)) for p in plans):
            # docs/boundary.md: a tied weight passed in and also used by the module is equal
            # to float rounding only where used more than once.
            for p in plans:
                p.ops = [op for op in p.ops if op != "shared"] or ["linear"]
        if exact and any("ext_out" in slots_of(p.out) for p in plans):
            # An input used in a call and also returned as it is: its gradient sums in another
            # order than eager's (docs/limits.md for an input used several times in a call and
            # also outside it; once and returned: the xfail in test_randomized.py).
            for p in plans:
                p.ops = [op for op in p.ops if op != "ext"] or ["linear"]
        self.blocks = nn.ModuleList(Block(plan, shared) for plan in plans)
        # How the model calls each block: "call" (module call), or a functional boundary.
        self.how = ["call"] * len(self.blocks)
        for block in self.blocks:  # frozen parts (LoRA-like), chosen at random
            for child in block.children():
                if child is not shared and rng.random() < 0.1:
                    child.requires_grad_(False)
        if rng.random() < 0.1:
            shared.requires_grad_(False)
        self.manager: Any = None
        self.collected: list[torch.Tensor] = []

    def forward(self, h: torch.Tensor, ext: torch.Tensor, cst: torch.Tensor,
                gen: torch.Generator) -> tuple[torch.Tensor, list[torch.Tensor]]:
        loss = torch.zeros(())
        self.collected.clear()
        leaves: list[Any] = []
        for block, how in zip(self.blocks, self.how):
            plan = block.plan
            values = call_values(plan, h, ext, cst, block.shared.weight, gen)
            args = build(plan.in_args, values)
            kwargs = build(plan.in_kwargs, values)
            if how == "call" or block.plain:
                out = block(*args, **kwargs)
            elif how == "checkpoint":
                out = pytree_ckpt.checkpoint(block, *args, **kwargs)
            else:
                out = pytree_ckpt.checkpointed(block, offload=self.manager)(*args, **kwargs)
            got: dict[str, Any] = {}
            walk(plan.out, out, got)
            leaves.extend(v for v in got.values() if isinstance(v, torch.Tensor))
            if "aux" in got:
                loss = loss + got["aux"]
            if "h_in" in got:
                loss = loss + 0.5 * got["h_in"].sum()
            if "hview" in got:
                loss = loss + 0.25 * got["hview"].square().sum()
            if "ext_out" in got:
                loss = loss + got["ext_out"].sum()
            if "cst_out" in got:  # an input requiring no grad comes back untouched
                loss = loss + got["cst_out"].sum()
                leaves.append(torch.tensor([got["cst_out"] is cst]))
            h = got["h"]
            if plan.caller_inplace:  # the caller changes the layer's output in place
                h.mul_(0.9)
        for t in self.collected:  # what forward hooks kept (a load-balancing loss)
            loss = loss + 0.01 * t.square().mean()
        return loss + h.square().mean(), leaves


# Not lin2: it consumes the discarded norm2 output, which a hook keeping its input would read
# after the discard freed it (docs/discard.md: a late reader crashes the process).
HOOKED = ["lin", "norm", "gate_proj", "qkv", "inner", "shared"]


def add_hook(model: Model, module: nn.Module, kind: str) -> None:
    """A forward hook keeping the module's output, or a pre-hook keeping its input."""
    def keep(t: Any) -> None:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            model.collected.append(t)

    if kind == "out":
        module.register_forward_hook(lambda mod, args, out: keep(out))
    else:
        module.register_forward_pre_hook(lambda mod, args: keep(args[0]))


# ---------------------------------------------------------------- wrapping

TARGETS = {
    SaveUnit.ATTN: KeptOps("aten::_scaled_dot_product_flash_attention_for_cpu",
                           "aten::_scaled_dot_product_flash_attention"),
    SaveUnit.MOE_GATE: KeptCallables("Block.route"),
    SaveUnit.DSA_INDEXER: KeptOps("aten::topk"),
}


def wrap(model: Model, rng: random.Random) -> list[str]:
    """Wrap the model's blocks at random, in place; returns what was done, for messages."""
    model.manager = offload.OffloadManager(
        offload.OffloadConfig(min_bytes=rng.choice([0, 64, 1 << 16]), prefetch=rng.randint(0, 2)),
        device="cpu")
    done = []
    if rng.random() < 0.15:  # torchtitan's way: every block at once, one manager
        ratio = rng.choice([0.5, 1.0])
        pytree_ckpt.checkpoint_layers(model.blocks, ratio=ratio, offload=model.manager)
        return [f"checkpoint_layers(ratio={ratio})"]
    for i, block in enumerate(model.blocks):
        off = rng.choice([False, True, model.manager, None])
        kind = rng.choice(["none", "aac", "aac", "rcfg", "checkpoint", "checkpointed"])
        if rng.random() < 0.3:
            pytree_ckpt.apply_activation_checkpointing(block.inner, offload=off)
            done.append(f"{i}:inner")
        if kind == "aac":
            pytree_ckpt.apply_activation_checkpointing(block, offload=off)
        elif kind == "rcfg":
            save = rng.sample(["attn", "moe_gate", "dsa_indexer"], rng.randint(1, 2))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a unit that keeps nothing is warned of
                pytree_ckpt.apply_recompute_config([block], RecomputeConfig(1.0, save=save),
                                                   TARGETS, offload=off)
            kind = f"rcfg{save}"
        elif kind in ("checkpoint", "checkpointed"):
            model.how[i] = kind
        done.append(f"{i}:{kind}:off={off if isinstance(off, (bool, type(None))) else 'mgr'}")
    return done


# ---------------------------------------------------------------- the differential run

def _equal(a: Any, b: Any, *, exact: bool = True) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    if exact:  # bit for bit; NaN where both are (a step that diverged) counts as equal
        return torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True)
    return torch.allclose(a, b, rtol=1e-4, atol=1e-5, equal_nan=True)


def rng_t(data: torch.Generator) -> int:
    """A sequence length per call: micro-batches and steps of other shapes."""
    return T + int(torch.randint(-1, 2, (), generator=data))


# What the cases ran, for the test to check that the random choices cover every feature.
COVERAGE: collections.Counter[str] = collections.Counter()


def run_case(seed: int, *, exact: bool = True, steps: int = 2) -> list[str]:
    """Returns the differences found between the eager twin and the wrapped model."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    eager = Model(rng, exact=exact)
    for block in eager.blocks:
        block.plain = True
    model = copy.deepcopy(eager)
    for block in model.blocks:
        block.plain = False
    wrap_seed = rng.randrange(1 << 30)
    done = wrap(model, random.Random(wrap_seed))
    between = rng.choice(["nothing"] * 4 + ["rewrap", "deepcopy"])
    done.append(f"between steps: {between}")
    if list(model.state_dict()) != list(eager.state_dict()):
        return [f"seed {seed}: state_dict keys changed by wrapping: {done}"]
    train = rng.random() < 0.8
    h_grad = rng.random() < 0.7
    micro = rng.choice([1, 1, 2])
    joint = rng.random() < 0.5  # micro-batches: every forward before one backward
    done.append(f"micro={micro}{' joint' if joint else ''}")
    how_backward = rng.choice(["plain"] * 5 + ["retain", "inputs", "grad"])
    no_grad_first = rng.random() < 0.15  # an inference forward before each step
    chosen = [rng.random() < 0.5 for _ in eager.parameters()]
    hooks = [(rng.randrange(len(eager.blocks)), rng.choice(HOOKED), rng.choice(["out", "in"]))
             for _ in range(rng.choice([0, 0, 0, 1, 2]))]
    if exact:  # docs/limits.md: a kept hooked output also used in the layer: float rounding
        hooks = []
    for m in (eager, model):
        for i, name, kind in hooks:
            add_hook(m, getattr(m.blocks[i], name), kind)
    done.append(f"backward={how_backward} no_grad_first={no_grad_first} hooks={hooks}")

    def describe() -> str:
        plans = [(b.plan.ops, b.plan.in_args, b.plan.in_kwargs, b.plan.out, b.plan.caller_inplace)
                 for b in eager.blocks]
        return f"wrap {done}, train={train}, h_grad={h_grad}, plans {plans}"

    def backward(m: Model, loss: torch.Tensor) -> None:
        if how_backward == "retain":
            loss.backward(retain_graph=True)
            loss.backward()
            return
        trainable = [p for p, c in zip(m.parameters(), chosen) if c and p.requires_grad]
        if how_backward == "plain" or not trainable:
            loss.backward()
        elif how_backward == "inputs":
            loss.backward(inputs=trainable)
        else:
            for p, g in zip(trainable, torch.autograd.grad(loss, trainable, allow_unused=True)):
                p.grad = g if p.grad is None or g is None else p.grad + g

    opts = [torch.optim.SGD(m.parameters(), lr=0.1 if exact else 1e-3) for m in (eager, model)]
    problems: list[str] = []

    def equal(a: Any, b: Any) -> bool:
        return _equal(a, b, exact=exact)

    def one_step(m: Model, opt: Any, step: int) -> Any:
        m.train(train)
        data = torch.Generator().manual_seed(seed * 10 + step)
        torch.manual_seed(seed * 100 + step)
        opt.zero_grad(set_to_none=True)
        losses, leaves, hs, exts = [], [], [], []
        if no_grad_first:
            with torch.no_grad():
                h = torch.randn(B, rng_t(data), D, generator=data)
                ext, cst = torch.randn(D, generator=data), torch.randn(D, generator=data)
                loss, out = m(h, ext, cst, data)
            leaves += [loss, *out]
        for _ in range(micro):
            h = torch.randn(B, rng_t(data), D, generator=data).requires_grad_(h_grad)
            ext = torch.randn(D, generator=data).requires_grad_()
            cst = torch.randn(D, generator=data)
            loss, out = m(h, ext, cst, data)
            if loss.requires_grad and not joint:  # else no parameter nor input needs grad
                backward(m, loss)
            losses.append(loss.detach() if not joint else loss)
            leaves += out
            hs.append(h)
            exts.append(ext)
        if joint and losses[0].requires_grad:
            backward(m, sum(losses))
        grads = [None if p.grad is None else p.grad.clone() for p in m.parameters()]
        opt.step()
        return (torch.stack([x.detach() for x in losses]), [t.detach() for t in leaves], grads,
                hs[-1].grad, exts[-1].grad)

    for step in range(steps):
        if step and between == "rewrap":
            for block in model.blocks:
                pytree_ckpt.remove_activation_checkpointing(block)
                pytree_ckpt.remove_activation_checkpointing(block.inner)
            model.how = ["call"] * len(model.blocks)
            wrap(model, random.Random(wrap_seed))
        elif step and between == "deepcopy":
            model.collected = []  # tensors with a graph cannot be deep-copied
            model = copy.deepcopy(model)
            opts[1] = torch.optim.SGD(model.parameters(), lr=0.1 if exact else 1e-3)
            model.collected = []
            for i, name, kind in hooks:  # deepcopy keeps the hooks, on the old list
                getattr(model.blocks[i], name)._forward_hooks.clear()
                getattr(model.blocks[i], name)._forward_pre_hooks.clear()
            for i, name, kind in hooks:
                add_hook(model, getattr(model.blocks[i], name), kind)
        results = []
        for m, opt in zip((eager, model), opts):
            try:
                results.append(one_step(m, opt, step))
            except Exception as error:  # noqa: BLE001
                if m is eager:  # not a valid program: nothing to compare
                    return []
                if how_backward == "retain" and "already replayed" in str(error):
                    return []  # docs/discard.md: a discarded output replayed twice is refused
                if hooks and "is a view and is being modified inplace" in str(error):
                    return []  # docs/limits.md: outputs viewing one another (one a hooked
                    # output) changed in place are refused by torch
                return [f"seed {seed}: {describe()}", f"step {step}: the wrapped model raised "
                        f"{type(error).__name__}: {error}"]
        (l0, o0, g0, h0, e0), (l1, o1, g1, h1, e1) = results
        stats = model.manager.stats(reset=True)  # the graphs are gone: nothing may be held
        COVERAGE["offloaded_bytes"] += stats["offloaded_bytes"]
        # A window no backward restores (a layer whose output is its input, unchanged, with
        # nothing needing grad) is copied for nothing, and reported as alive elsewhere.
        unrestored = stats["offloaded_bytes"] - stats["restored_bytes"]
        # A restricted backward (inputs=, autograd.grad) may not reach a window at all.
        restricted = how_backward in ("inputs", "grad")
        if stats["host_buffers_in_use"] or unrestored < 0 or (
                not restricted and unrestored > stats["alive_elsewhere_bytes"]):
            problems.append(f"step {step}: offload stats after the step {stats}")
        if not equal(l0, l1):
            problems.append(f"step {step}: loss {l0.tolist()} vs {l1.tolist()}")
        if len(o0) != len(o1):
            problems.append(f"step {step}: {len(o0)} vs {len(o1)} output leaves")
        for i, (a, b) in enumerate(zip(o0, o1)):
            if not equal(a, b):
                problems.append(f"step {step}: output leaf {i} of {len(o0)} differs"
                                + (f": {a.tolist()} vs {b.tolist()}" if i == len(o0) - 1 else ""))
        names = [n for n, _ in eager.named_parameters()]
        for n, a, b in zip(names, g0, g1):
            if not equal(a, b):
                problems.append(f"step {step}: grad {n} differs" + (
                    "" if a is None or b is None else
                    f" by {(a - b).abs().max().item():.3g} of {a.abs().max().item():.3g}"))
        if not equal(h0, h1):
            problems.append(f"step {step}: input h grad differs")
        if not equal(e0, e1):
            problems.append(f"step {step}: ext grad differs")
        for (n, a), b in zip(eager.named_buffers(), model.buffers()):
            if not equal(a, b):
                problems.append(f"step {step}: buffer {n} differs")
        for (n, a), b in zip(eager.named_parameters(), model.parameters()):
            if not equal(a, b):
                problems.append(f"step {step}: parameter {n} differs after SGD")
    COVERAGE.update(op for block in eager.blocks for op in block.plan.ops)
    COVERAGE.update(d.split(":")[1].split("[")[0] for d in done if d[0].isdigit())
    COVERAGE.update(d.split("(")[0] for d in done if d.startswith("checkpoint_layers"))
    COVERAGE.update(d for d in done if d.startswith("between") and "nothing" not in d)
    COVERAGE[f"backward={how_backward}"] += 1
    COVERAGE["micro-batches"] += micro > 1
    COVERAGE["hooks"] += bool(hooks)
    COVERAGE["caller in place"] += any(b.plan.caller_inplace for b in eager.blocks)
    if problems:
        problems.insert(0, f"seed {seed}: {describe()}")
    return problems


@pytest.mark.filterwarnings("ignore")  # inert save units, offload that moved nothing, hooks
def test_random_models_calls_and_wrappers_match_the_eager_twin_exactly() -> None:
    COVERAGE.clear()
    failures = [p for seed in range(CASES) for p in run_case(seed)]
    assert not failures, "\n".join(failures[:20])
    # The fixed seeds reach every layer op, every wrapper and every way of training.
    missing = [name for name in [*PLAIN_OPS, *NEEDS, "aac", "rcfg", "checkpoint",
                                 "checkpointed", "inner", "checkpoint_layers",
                                 "between steps: rewrap", "between steps: deepcopy",
                                 "backward=retain", "backward=inputs", "backward=grad",
                                 "micro-batches", "caller in place", "offloaded_bytes"]
               if not COVERAGE[name]]
    assert not missing, missing


if __name__ == "__main__":  # python -m tests.test_randomized FIRST COUNT [loose]
    import sys

    first, count = int(sys.argv[1]), int(sys.argv[2])
    warnings.simplefilter("ignore")
    found = [p for seed in range(first, first + count)
             for p in run_case(seed, exact=sys.argv[3:] != ["loose"])]
    print("\n".join(found) or f"{count} cases, no difference")
