"""One rank of DDP around pytree-ckpt layers against the same DDP around the eager twin.

    python tests/distributed/ddp_twin_cases.py OUT_DIR [CASE ...]

Each case trains a fresh copy of one model (seed 0) twice under DDP on the same per-rank
batches: plain, and with its layers wrapped by pytree-ckpt; it compares every step's gradients
and the final parameters and buffers bit for bit and writes OUT_DIR/rank<r>.json: case ->
"OK", "DIFF ..." or "RAISE ...". (helper RE, session 47.)
"""
import copy, os, sys, traceback, warnings, contextlib
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
import pytree_ckpt, offload
warnings.filterwarnings("ignore")
torch.set_num_threads(1)

class Block(nn.Module):
    def __init__(s, d=8):
        super().__init__(); s.a = nn.Linear(d, d); s.b = nn.Linear(d, d)
    def forward(s, x):
        return x + s.b(torch.tanh(s.a(x)))

class Net(nn.Module):
    def __init__(s, n=3, d=8):
        super().__init__(); s.layers = nn.ModuleList(Block(d) for _ in range(n)); s.head = nn.Linear(d, 1)
        s.skip = set()
    def forward(s, x):
        for i, l in enumerate(s.layers):
            if i in s.skip: continue
            x = l(x)
        return s.head(x)

class MoE(nn.Module):
    def __init__(s, d=8):
        super().__init__(); s.e = nn.ModuleList(nn.Linear(d, d) for _ in range(2))
    def forward(s, x):
        out = torch.zeros_like(x)
        m = x[:, 0] > s.thr
        for k, e in enumerate(s.e):
            sel = m if k else ~m
            if sel.any():
                out = out.index_add(0, sel.nonzero()[:, 0], e(x[sel]))
        return x + out

class BNBlock(nn.Module):
    def __init__(s, d=8):
        super().__init__(); s.a = nn.Linear(d, d); s.bn = nn.BatchNorm1d(d)
    def forward(s, x):
        return x + torch.tanh(s.bn(s.a(x)))

class Tied(nn.Module):
    def __init__(s, d=8):
        super().__init__(); s.emb = nn.Linear(d, d, bias=False); s.blk = TiedBlock(s.emb)
    def forward(s, x):
        h = s.emb(x); h = s.blk(h); return (h @ s.emb.weight).sum(-1, keepdim=True)

class TiedBlock(nn.Module):
    def __init__(s, emb):
        super().__init__(); s.lin = nn.Linear(8, 8); s.shared = emb.weight  # registers as param
    def forward(s, x):
        return torch.tanh(s.lin(x) @ s.shared)

def batch(rank, step, micro=0, n=6):
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)

def cmp(name, a, b, what):
    bad = []
    for (n1, p1), (n2, p2) in zip(a.named_parameters(), b.named_parameters()):
        if what == "grad":
            x, y = p1.grad, p2.grad
            if (x is None) != (y is None): bad.append(f"{n1}: grad None {x is None} vs {y is None}")
            elif x is not None and not torch.equal(x, y): bad.append(f"{n1}: grad maxdiff {(x-y).abs().max().item():.3g}")
        else:
            if not torch.equal(p1, p2): bad.append(f"{n1}: param maxdiff {(p1-p2).abs().max().item():.3g}")
    if what == "param":
        for (n1, b1), (n2, b2) in zip(a.named_buffers(), b.named_buffers()):
            if not torch.equal(b1.float(), b2.float()): bad.append(f"buffer {n1}: {b1.float().sub(b2.float()).abs().max().item():.3g}")
    return bad

def train(model, wrap, steps, rank, opt_kind="sgd", micro=1, skip_fn=None, ddp_kw=None,
          hook=None, join=False, loss_kind="mse", set_to_none=True):
    ddp = wrap(model)
    if hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
        ddp.register_comm_hook(ps.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2, min_compression_rate=0.5, use_error_feedback=True, warm_start=True, random_seed=0), ps.powerSGD_hook)
    elif hook is not None: ddp.register_comm_hook(*hook)
    if opt_kind == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.SGD, lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    grads = []
    nsteps = steps + (1 if (join and rank == 1) else 0)
    ctx = contextlib.nullcontext()
    if join:
        from torch.distributed.algorithms.join import Join
        ctx = Join([ddp])
    with ctx:
        for step in range(nsteps):
            opt.zero_grad(set_to_none=set_to_none)
            nm = (1 if step == 0 else 2) if micro == "late" else micro
            for m in range(nm):
                if skip_fn is not None: skip_fn(model, step, m, rank)
                x, y = batch(rank, step, m)
                sync = ddp.no_sync() if m < nm - 1 else contextlib.nullcontext()
                with sync:
                    loss = ((ddp(x) - y) ** 2).mean()
                    loss.backward()
            grads.append({n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()})
            opt.step()
    return grads

def compare_runs(case, rank, build, ckpt, steps=3, ddp_kw=None, before=False, **kw):
    kw["steps"] = steps
    ddp_kw = ddp_kw or {}
    torch.manual_seed(0)
    base = build()
    eager, mine = copy.deepcopy(base), copy.deepcopy(base)
    wck = kw.pop("wrapper_ckpt", None)
    ge = train(eager, lambda m: DDP(m, **ddp_kw), rank=rank, **kw)
    if before:
        def wrap(m):
            d = DDP(m, **ddp_kw); ckpt(m); return d
    else:
        ckpt(mine); wrap = lambda m: DDP(m, **ddp_kw)
        if wck is not None:
            def wrap(m):
                d = DDP(m, **ddp_kw); wck(d); return d
    gm = train(mine, wrap, rank=rank, **kw)
    bad = []
    for s, (a, b) in enumerate(zip(ge, gm)):
        for n in a:
            x, y = a[n], b[n]
            if (x is None) != (y is None): bad.append(f"step{s} {n}: grad None eager={x is None} mine={y is None}")
            elif x is not None and not torch.equal(x, y): bad.append(f"step{s} {n}: grad maxdiff {(x-y).abs().max().item():.3g}")
    bad += cmp(case, eager, mine, "param")
    return bad

def ck_layers(m):
    for l in m.layers: pytree_ckpt.apply_activation_checkpointing(l, offload=False)
def ck_layers_offload(m):
    mgr = offload.OffloadManager(offload.OffloadConfig(min_bytes=0), device="cpu")
    pytree_ckpt.checkpoint_layers(m.layers, ratio=1.0, offload=mgr)
def ck_save_units(m):
    from pytree_ckpt import RecomputeConfig, SaveUnit, KeptOps
    pytree_ckpt.apply_recompute_config(m.layers, RecomputeConfig(1.0, save=["attn"]),
                                       {SaveUnit.ATTN: KeptOps("aten::addmm")}, offload=False)
def ck_check_fn(m):
    pytree_ckpt.apply_activation_checkpointing(m, check_fn=lambda x: isinstance(x, (Block, MoE, BNBlock, TiedBlock)), offload=False)

def net(): return Net()
def moe_net():
    n = Net(); n.layers[1] = MoE(); n.layers[1].thr = 10.0  # expert 1 never reached
    return n
def moe_net_rank():
    n = Net(); n.layers[1] = MoE(); n.layers[1].thr = 0.0 if dist.get_rank() == 0 else 10.0
    return n
def bn_net():
    n = Net(); n.layers[1] = BNBlock(); return n
def syncbn_net():
    n = Net(); n.layers[1] = BNBlock(); return nn.SyncBatchNorm.convert_sync_batchnorm(n)

def layerdrop(model, step, m, rank): model.skip = {1} if step == 1 else set()
def early_exit(model, step, m, rank): model.skip = {2} if (rank == 1 and step != 0) else set()

def my_allreduce_hook(state, bucket):
    t = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0])

def cases():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
    fu = {"find_unused_parameters": True}
    return {
        "basic": dict(build=net, ckpt=ck_layers),
        "offload": dict(build=net, ckpt=ck_layers_offload),
        "save_units": dict(build=net, ckpt=ck_save_units),
        "no_sync_accum": dict(build=net, ckpt=ck_layers_offload, micro=3),
        "no_sync_accum_fu": dict(build=net, ckpt=ck_layers, micro=3, ddp_kw=fu),
        "layerdrop_fu": dict(build=net, ckpt=ck_layers, skip_fn=layerdrop, ddp_kw=fu),
        "early_exit_fu": dict(build=net, ckpt=ck_layers, skip_fn=early_exit, ddp_kw=fu),
        "moe_idle_fu": dict(build=moe_net, ckpt=ck_check_fn, ddp_kw=fu),
        "moe_idle_rank_fu": dict(build=moe_net_rank, ckpt=ck_check_fn, ddp_kw=fu),
        "moe_idle_fu_accum": dict(build=moe_net, ckpt=ck_check_fn, ddp_kw=fu, micro=2),
        "moe_idle_static": dict(build=moe_net, ckpt=ck_check_fn, ddp_kw={"static_graph": True}),
        "static_graph": dict(build=net, ckpt=ck_layers, ddp_kw={"static_graph": True}),
        "bucket_view": dict(build=net, ckpt=ck_layers, ddp_kw={"gradient_as_bucket_view": True}),
        "bucket_view_accum": dict(build=net, ckpt=ck_layers, ddp_kw={"gradient_as_bucket_view": True}, micro=2),
        "fp16_hook": dict(build=net, ckpt=ck_layers, hook=(None, dh.fp16_compress_hook)),
        "my_hook": dict(build=net, ckpt=ck_layers, hook=(None, my_allreduce_hook)),
        "zero": dict(build=net, ckpt=ck_layers, opt_kind="zero"),
        "tied": dict(build=Tied, ckpt=ck_check_fn),
        "tied_fu": dict(build=Tied, ckpt=ck_check_fn, ddp_kw=fu),
        "bn": dict(build=bn_net, ckpt=ck_check_fn),
        "bn_nobcast": dict(build=bn_net, ckpt=ck_check_fn, ddp_kw={"broadcast_buffers": False}),
        "ddp_before_ckpt": dict(build=net, ckpt=ck_layers, before=True),
        "ddp_before_ckpt_fu": dict(build=net, ckpt=ck_layers, before=True, ddp_kw=fu),
        "join_uneven": dict(build=net, ckpt=ck_layers, join=True),
        "join_uneven_offload": dict(build=net, ckpt=ck_layers_offload, join=True),
        "small_buckets": dict(build=net, ckpt=ck_layers, ddp_kw={"bucket_cap_mb": 0.0001}),
    }

def main():
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    out, want = sys.argv[1], sys.argv[2:]
    results = {}
    for name, spec in {**cases(), **more_cases(), **third_cases(), **fourth_cases()}.items():
        if want and name not in want: continue
        try:
            bad = compare_runs(name, rank, **spec)
            results[name] = 'OK' if not bad else 'DIFF ' + '; '.join(bad[:4])
        except Exception as e:
            results[name] = f"RAISE {type(e).__name__}: {str(e)[:400]}"
        dist.barrier()
    import json
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def bucket_norm_hook(state, bucket):
    # a per-bucket operation (per-bucket clipping / scaling): depends on bucket composition
    t = bucket.buffer()
    t.div_(dist.get_world_size() * (1.0 + t.norm()))
    return dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0])

def bucket_record_hook(state, bucket):
    state.append(sorted(p.shape.numel() for p in bucket.parameters()) + [bucket.index()])
    t = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0])

class Twice(nn.Module):
    def __init__(s):
        super().__init__(); s.blk = Block(); s.head = nn.Linear(8, 1)
    def forward(s, x):
        return s.head(s.blk(s.blk(x)))
def ck_twice(m): pytree_ckpt.apply_activation_checkpointing(m.blk, offload=False)

def ck_torch_reentrant(m):
    import torch.utils.checkpoint as tuc
    for l in m.layers if hasattr(m, "layers") else [m.blk]:
        f = l.forward
        l.forward = (lambda f: lambda x: tuc.checkpoint(f, x, use_reentrant=True))(f)
def ck_torch_nonreentrant(m):
    import torch.utils.checkpoint as tuc
    for l in m.layers if hasattr(m, "layers") else [m.blk]:
        f = l.forward
        l.forward = (lambda f: lambda x: tuc.checkpoint(f, x, use_reentrant=False))(f)

class DiscardNet(Net):
    def forward(s, x):
        for i, l in enumerate(s.layers):
            cwo = pytree_ckpt.CheckpointWithoutOutput()
            h = cwo.checkpoint(torch.tanh, l.a(x))
            y = l.b(h)
            cwo.discard_output_and_register_recompute(y)
            x = x + y
        return s.head(x)
def ck_none(m): pass

def more_cases():
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
    fu = {"find_unused_parameters": True}
    sb = {"bucket_cap_mb": 0.0003}
    return {
        "twice": dict(build=Twice, ckpt=ck_twice),
        "twice_fu": dict(build=Twice, ckpt=ck_twice, ddp_kw=fu),
        "twice_static": dict(build=Twice, ckpt=ck_twice, ddp_kw={"static_graph": True}),
        "discard": dict(build=lambda: DiscardNet(), ckpt=ck_none),
        "discard_in_ckpt": dict(build=lambda: DiscardNet(), ckpt=ck_layers),
        "join_uneven_fu_layerdrop": dict(build=net, ckpt=ck_layers, join=True, ddp_kw=fu, skip_fn=layerdrop),
        "static_graph_accum_late": dict(build=net, ckpt=ck_layers, ddp_kw={"static_graph": True}, micro="late"),
    }


def route(model, step, m, rank):  # expert 1 reached on some micro-batches / ranks only
    model.layers[1].thr = 10.0 if (step + m + rank) % 2 == 0 else 0.0
class DeadOut(Net):
    def forward(s, x):
        for i, l in enumerate(s.layers):
            y = l(x)
            if not (i == 1 and s.dead): x = y
        return s.head(x)
def dead_net():
    n = DeadOut(); n.dead = False; return n
def dead_fn(model, step, m, rank): model.dead = (rank == 1 and step >= 1)
def ck_verify(m):
    for l in m.layers: pytree_ckpt.apply_activation_checkpointing(l, offload=False, verify_replay=True)
def ck_check_fn_off(m):
    mgr = offload.OffloadManager(offload.OffloadConfig(min_bytes=0), device="cpu")
    pytree_ckpt.apply_activation_checkpointing(m, check_fn=lambda x: isinstance(x, (Block, MoE)), offload=mgr)

def third_cases():
    fu = {"find_unused_parameters": True}
    return {
        "moe_route_accum_fu": dict(build=moe_net, ckpt=ck_check_fn, ddp_kw=fu, micro=3, skip_fn=route),
        "moe_route_accum_fu_keepgrad": dict(build=moe_net, ckpt=ck_check_fn, ddp_kw=fu, micro=3, skip_fn=route, set_to_none=False),
        "moe_route_accum_fu_offload": dict(build=moe_net, ckpt=ck_check_fn_off, ddp_kw=fu, micro=3, skip_fn=route),
        "moe_route_join_fu": dict(build=moe_net, ckpt=ck_check_fn, ddp_kw=fu, skip_fn=route, join=True),
        "moe_route_bucketview_fu": dict(build=moe_net, ckpt=ck_check_fn, ddp_kw={**fu, "gradient_as_bucket_view": True}, micro=2, skip_fn=route),
        "moe_route_zero_fu": dict(build=moe_net, ckpt=ck_check_fn, ddp_kw=fu, skip_fn=route, opt_kind="zero"),
        "dead_output_fu": dict(build=dead_net, ckpt=ck_layers, ddp_kw=fu, skip_fn=dead_fn),
        "verify_replay": dict(build=net, ckpt=ck_verify, micro=2),
    }

class FnNet(Net):
    def forward(s, x):
        for l in s.layers:
            x = s.how(l, x)
        return s.head(x)
def fn_net(how):
    def b():
        n = FnNet(); n.how = how; return n
    return b
def via_module(l, x): return pytree_ckpt.checkpoint(l, x)
def via_closure(l, x): return pytree_ckpt.checkpoint(lambda t: l(t), x)
def via_checkpointed(l, x): return pytree_ckpt.checkpointed(l)(x)
def ck_on_ddp_wrapper(d):
    pytree_ckpt.apply_activation_checkpointing(d, check_fn=lambda x: isinstance(x, Block), offload=False)

def fourth_cases():
    fu = {"find_unused_parameters": True}
    return {
        "fn_module": dict(build=fn_net(via_module), ckpt=ck_none, micro=2),
        "fn_module_fu": dict(build=fn_net(via_module), ckpt=ck_none, ddp_kw=fu),
        "fn_closure": dict(build=fn_net(via_closure), ckpt=ck_none, micro=2),
        "fn_closure_static": dict(build=fn_net(via_closure), ckpt=ck_none, ddp_kw={"static_graph": True}),
        "fn_checkpointed_static": dict(build=fn_net(via_checkpointed), ckpt=ck_none, ddp_kw={"static_graph": True}),
        "check_fn_on_ddp": dict(build=net, ckpt=ck_none, wrapper_ckpt=ck_on_ddp_wrapper, ddp_kw=fu),
    }

if __name__ == "__main__":
    main()
