"""What the boundary knows of the modules a call uses.

- which module ``fn`` belongs to (``owning_module``);
- their trainable parameters and their buffers, read per call from ``_parameters`` and
  ``_buffers`` dicts cached per module, and kept fresh when the module tree changes (torch's
  registration hooks, and a structure check for edits that bypass them);
- whether a module's graph was verified to reach no tensor that would silently get no gradient
  (``foreign_leaves``, once per module and structure);
- lazy modules not yet materialized, and forward hooks inside the boundary (warned about).

What the original pass changes of their state is in ``state_changes.py``; what they were
then, in ``forward_modules.py``.
"""

from __future__ import annotations

import enum
import functools
import operator
import sys
import types
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from .eager import HOOK_REASON, Told, runs_eagerly, user_stacklevel
from .hook_outputs import is_library_hook, keeps_output_as_is
from .tree import POSITIONAL_CALL_SPECS, dunder

__all__ = ["DroppedOnCopy", "GENERATORS_CACHE", "ModuleDicts", "any_lazy", "argument_module",
           "call_switches", "changed_submodule", "collect_parameters", "drop_caches",
           "ever_verified", "foreign_leaves", "graph_attributes", "graph_reaches", "is_verified",
           "mark_verified", "module_buffers", "module_dicts", "owning_module",
           "structure_generation", "submodules_now", "torch_nn_class", "trainable_parameters",
           "warn_forward_hooks", "watch_module_structure", "watch_tree", "with_its_module"]


def owning_module(fn: Callable[..., Any], /) -> nn.Module | None:
    """The module whose parameters ``fn`` uses: ``fn`` itself, the module of a bound method, or
    the module a partial binds first to a function of its class (NOTE [a method bound by a
    partial]), seen through ``functools.partial`` and wrappers that set ``__wrapped__``;
    ``None`` for any other callable (NOTE [unknown callables] in boundary.py)."""
    for _ in range(8):  # through partials and wrappers (torch.compiler.disable, functools.wraps)
        if isinstance(fn, functools.partial):
            if fn.args and isinstance(fn.args[0], nn.Module) and \
                    _method_of(fn.args[0], fn.func):
                return fn.args[0]  # NOTE [a method bound by a partial]
            fn = fn.func
        elif not isinstance(fn, nn.Module) and dunder(fn, "__self__") is None and \
                dunder(fn, "__wrapped__") is not None:
            fn = getattr(fn, "__wrapped__")
        else:
            break
    if isinstance(fn, nn.Module):
        return fn
    owner = dunder(fn, "__self__")
    return owner if isinstance(owner, nn.Module) else None


def with_its_module(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                    /) -> Callable[..., Any]:
    """``fn`` as a method of the module it is given, for the module watches of a reused call
    where ``fn`` has no module of its own (NOTE [a module given to a reused call]); else
    ``fn``."""
    if isinstance(fn, nn.Module) or isinstance(dunder(fn, "__self__"), nn.Module) or \
            owning_module(fn) is not None:  # a module's method, under partials and wrappers
        return fn  # (the usual case, a bound method, told first)
    if args and isinstance(args[0], nn.Module) and dunder(fn, "__self__") is None and \
            _method_of(args[0], fn):
        return functools.partial(fn, args[0])  # NOTE [a method bound by a partial]
    bound = ()
    inner = fn
    for _ in range(8):  # what partials bind: `partial(route, self.router)`
        if not isinstance(inner, functools.partial):
            break
        bound += (*inner.args, *inner.keywords.values())
        inner = inner.func
    given = next((value for value in (*args, *kwargs.values(), *bound)
                  if isinstance(value, nn.Module)), None)
    return fn if given is None else types.MethodType(fn, given)


# NOTE [a module given to a reused call]: `reuse_during_recompute(Router.route, self.router,
# h)`, a free function's `reuse_during_recompute(route, h, self.router)`, or one a partial
# binds it to (`partial(route, self.router)`): what the call changes of that module (a count, a
# buffer, a float stored there) is the module watches' to record and to put back for the
# replay, as for `self.router.route` (helper JG). A module is not read as an argument is (its
# attributes are its state), so a free function's `router.calls += 1` was neither recorded nor
# undone: the replay read the count as before the forward (0, not 1) and the gradients
# differed from eager's, silently. The first module given is watched (a positional argument,
# then a keyword's, then what partials bind; not one held inside a container): one module's
# state per reused call, as a bound method's. A function with a module of its own (a module's
# method, under partials and wrappers: helper JX) keeps that one. The binding is for the module
# watches only: the call runs ``fn`` as given, and what ``fn`` binds or closes over (a stats
# dict a partial binds, a plain helper object's own attributes) is read from ``fn`` itself
# (``argument_contents``). A class's function is bound by a partial, which owning_module reads
# as the module's method anywhere; any other callable by ``MethodType``, whose ``__self__``
# is the module: the boundary never sees this binding, so a helper given a module is not
# taken for that module's forward where it is the checkpointed function.


# NOTE [a method bound by a partial]: transformers 5.24's GradientCheckpointingLayer wraps each
# layer class's forward and calls its checkpoint function with
# ``partial(forward, self, **kwargs)``: the class's plain function, the layer bound as its first
# argument, which is ``self.forward`` in all but name. Taken as an unknown callable (NOTE
# [unknown callables] in boundary.py), the layer's module state was not known (a batch norm's
# running statistics moved twice a step), nor its hooks (an MoE router's logits, captured by
# transformers' output hooks for the load-balancing loss, lost their gradient), and
# torch.autograd.grad was refused. Only a function the module's class (or a base) defines,
# possibly under wrappers that set ``__wrapped__``, counts: a helper taking a module first may
# use any other module's parameters. The partial's function may be such a wrapper itself
# (``torch.compile(Layer.forward)``, ``torch.compiler.disable``): its ``__wrapped__`` chain is
# walked too, as owning_module walks a wrapped bound method's.
def _method_of(module: nn.Module, func: Any, /) -> bool:
    name = dunder(func, "__name__")
    if not isinstance(name, str):
        return False
    chain = []
    for _ in range(8):  # func, then what it wraps, down to a plain function
        if func is None or dunder(func, "__self__") is not None:
            break
        chain.append(func)
        func = dunder(func, "__wrapped__")
    if not chain:
        return False
    for klass in type(module).__mro__:
        attribute = klass.__dict__.get(name)
        for _ in range(8):  # through the wrappers transformers (and FSDP2's subclass) add
            if attribute is None:
                break
            if any(attribute is f for f in chain):
                return True
            attribute = dunder(attribute, "__wrapped__")
    return False


def argument_module(leaf: Any, /) -> nn.Module | None:
    """The module an argument is, or whose method (or partial of one) it is. A method of the
    root model passed to every layer (its ``gated`` or ``log``) makes all of the model's
    parameters inputs of each layer's call: correct (the method may use any of them), at a
    cost in the square of the layer count."""
    if isinstance(leaf, nn.Module):
        return leaf
    if isinstance(leaf, (int, float, str, bool, type)) or not callable(leaf):
        return None
    return owning_module(leaf)


_DICTS = "_pytree_ckpt_dicts"
# Where held_generators.py caches the generators a tree holds (NOTE [generators held as
# attributes] there); dropped with the other caches.
GENERATORS_CACHE = "_pytree_ckpt_generators"
_VERIFIED = "_pytree_ckpt_verified"
# Bumped whenever a watched module gets a submodule, or a buffer under a new name (torch's
# global registration hooks, installed at the first boundary call, or when a boundary keeping
# methods is made: kept_owners.py): cached parameter dicts and verifications older than it are
# stale.
_structure_generation = 0
_hook_installed = False
# NOTE [only watched trees move the generation]: the modules of every tree whose structure
# something here cached (added where _check_structure caches a tree's shape, and a keeping
# layer's tree when its boundary is made). A registration on any other module (one being
# built: a metric, a probe made each step) cannot make a cache stale, and once moved the
# generation every layer redid its first-call checks at its next call (helper EG: 30-40% more
# CPU time a step for a small stack building one module a step). A module attached to a
# watched one is registered on it (a bump), and its tree is watched from the next cache on.
# Marked in the module's own __dict__ (a copy or pickle carries None: watched from its own
# first call), not held in a set: the buffer hook reads the mark where dynamo traces it (NOTE
# [global hooks stay eager]), and a module class defining __eq__ without __hash__ (a dataclass
# module, helper EL) needs no hashing.
_WATCHED = "_pytree_ckpt_watched"


def _watched(module: nn.Module, /) -> bool:
    return module.__dict__.get(_WATCHED) is not None


def _watch(modules: Iterable[nn.Module], /) -> None:
    for m in modules:
        m.__dict__[_WATCHED] = _WATCHED_MARK


def watch_tree(module: nn.Module, /) -> None:
    """Have registrations in ``module``'s tree move the structure generation. A module still
    being built (a copy, whose boundary is made before its submodules are) is watched from its
    first call instead, when its tree is cached."""
    if "_modules" in module.__dict__:
        _watch(module.modules())


# NOTE [global hooks stay eager]: these hooks run for every module anyone builds, and torch
# calls the buffer one at every buffer assignment (`self.count += 1`), compiled code included
# (compiled autograd builds an OptimizedModule inside a compiled step). Traced, dynamo read the
# half-built module and failed (KeyError: _orig_mod) for models that never met a boundary; so
# the counting runs eagerly, and opaque to dynamo. An opaque call where dynamo traces is a
# graph break, and under fullgraph=True a refusal: every compiled module assigning a buffer
# broke, once any boundary had run in the process (helper FN). So the submodule hook returns
# at once where dynamo traces it (is_compiling(); a submodule registered in traced code is
# seen by the boundary's own structure check, _check_structure), and the buffer hook is
# traced up to its test of the name and of the module's watch mark: a reassignment
# (`self.count += 1`), or a new name on a module no boundary met, ends there; a new name on a
# watched module goes on to the opaque count (a graph break; under fullgraph=True, dynamo's
# refusal quoting HOOK_REASON, which says what to do). Uncounted, the replay of a layer that
# compiled code gave a buffer read it as its forward left it (helper FR); counted by a traced
# increment, dynamo guarded on the count's value and recompiled at every call.
def _bump_generation(module: nn.Module, name: str, submodule: Any) -> None:
    if not torch.compiler.is_compiling():
        _count_submodule(module)


@runs_eagerly(HOOK_REASON)
def _count_submodule(module: nn.Module) -> None:
    global _structure_generation
    if _watched(module):  # NOTE [only watched trees move the generation]
        _structure_generation += 1


def _bump_generation_for_new_buffer(module: nn.Module, name: str, buffer: Any) -> None:
    # NOTE [global hooks stay eager]; an unwatched module's never counts (compiled code of a
    # module that never met a boundary registering a lazy buffer: no graph break). A name
    # registered as None and given a tensor later is not counted (helper FT counted it: a
    # layer filling and clearing one each call then moved the generation twice a step, every
    # layer redoing its first-call checks, and its fullgraph body broke: helper FV).
    if name not in module._buffers and getattr(module, _WATCHED, None) is not None:
        _count_buffer(module, name)


@runs_eagerly(HOOK_REASON)
def _count_buffer(module: nn.Module, name: str) -> None:
    # NOTE [a new buffer is new state]: a buffer registered under a new name is state a
    # forward may change (the deprecated spectral_norm registers its u and v and a pre-hook
    # that iterates them, with no submodule): the layers' next calls must clone their small
    # buffers before the forward, as at their first calls (snapshots_wanted in
    # state_changes.py), or a layer that already replayed would replay from what its forward
    # left. A buffer reassigned under its name (an EMA, each call) goes through torch's
    # register_buffer too, and is no new state: not counted (the hook's own test).
    global _structure_generation
    _structure_generation += 1


def watch_module_structure() -> None:
    """Install torch's global registration hooks that move ``structure_generation`` (once)."""
    global _hook_installed
    if not _hook_installed:
        nn.modules.module.register_module_module_registration_hook(_bump_generation)
        nn.modules.module.register_module_buffer_registration_hook(
            _bump_generation_for_new_buffer)
        _hook_installed = True


_SHAPE = "_pytree_ckpt_shape"


def _dropped() -> None:
    return None


class DroppedOnCopy:
    """A cache in a module's ``__dict__`` that a copy or pickle of it does not carry (rebuilt at
    the next call): what it holds points at the original's submodules."""

    __slots__ = ()

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return _dropped, ()

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        return None


_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def _plain_leaf(module: nn.Module, /) -> bool:
    # One of torch.nn's own leaf classes (Linear, LayerNorm, an activation), which never
    # reassign their _modules: checked by their dict staying empty. A container class (whose
    # __delitem__ reassigns it even when empty) or a class of the user's (a container that
    # clears itself with a new dict: helper FT) is checked as a holder.
    return not isinstance(module, _CONTAINERS) and torch_nn_class(module)


class _Watch(DroppedOnCopy):
    """The mark of a watched module (NOTE [only watched trees move the generation])."""

    __slots__ = ()


_WATCHED_MARK = _Watch()


class _Shape(DroppedOnCopy):
    """The cached shape of a module tree (weak references, which cannot be pickled)."""

    __slots__ = ("generation", "containers", "childless", "deaths")

    def __init__(self, generation: int, tree: list[nn.Module]) -> None:
        self.generation = generation
        # (weak reference, its _modules, their ids) for each module holding submodules, and
        # each of torch's container classes, whose __delitem__ gives it a new dict even when
        # empty (helper FR: `del adapters[:]` on an empty ModuleList, then an insert).
        self.containers = tuple((weakref.ref(m), m._modules, tuple(map(id, m._modules.values())))
                                for m in tree if m._modules or not _plain_leaf(m))
        # The _modules dict of each other module, holding none.
        self.childless = tuple(m._modules for m in tree if not m._modules and _plain_leaf(m))
        # Weak references whose callbacks move the generation when a module of the tree is
        # freed while its root lives; dropped with this shape, their callbacks never run.
        freed = functools.partial(_module_freed, weakref.ref(tree[0]))
        self.deaths = tuple(weakref.ref(m, freed) for m in tree)


def _module_freed(root: weakref.ref[nn.Module], ref: weakref.ref[nn.Module]) -> None:
    # A module of a cached tree freed while the tree's root lives (one replaced, whose id a new
    # module may take: see _check_structure): the caches are stale. A whole model freed (its
    # root first, or all at once by the garbage collector, which clears the references before
    # any callback) moves nothing: other models' layers would redo their first-call checks.
    global _structure_generation
    if root() is not None:
        _structure_generation += 1


def drop_caches(module: nn.Module, /) -> None:
    """Forget what the boundary cached on ``module`` (rebuilt at its next call)."""
    for name in (_DICTS, _VERIFIED, _SHAPE, GENERATORS_CACHE):
        module.__dict__.pop(name, None)


def _check_structure(module: nn.Module) -> None:
    """Bump the generation when ``module``'s tree changed behind torch's registration hooks.

    ``ModuleList.insert``, ``Sequential.insert`` and deleting a submodule edit ``_modules``
    directly, and no hook fires: a layer inserted so would silently get no gradient. Each
    submodule's ``_modules`` dict and its size show it (``del module_list[i]`` replaces the
    dict; an insert grows it), and, for those holding submodules, their children's ids:
    ``parent._modules[name] = new`` (torch.ao's ``prepare_qat``/``convert``, a LoRA wrapper put
    in so) keeps the dict and its size, and the old module alive where something holds it
    (helper FI: the adapter got no gradient, silently). Ids, not the children: a replaced one
    must be freed as in eager (helper FJ); one freed and its id reused by the new one is told
    by the callback of a weak reference (``_Shape.deaths``), which moves the generation. Weak
    references to the submodules: no reference cycle. A module holding none is checked by its
    dict staying empty only, without reading the module: a submodule put into it is an insert
    into that dict (its own ``insert`` or ``_modules[name] = m``; ``add_module`` and attribute
    assignment run the hooks), and one removed or replaced shows in its parent's ids; only a
    ``_modules`` dict of its own reassigned is not seen, so only torch.nn's own leaf classes
    are checked so (``_plain_leaf``): its container classes, whose ``__delitem__`` reassigns
    it even when empty, and classes of the user's are checked as holders. Cost per check (run
    twice a call): about 0.5 us for the 7-module layer of examples.bench_boundary, 1.05 us
    when every module was read (helper FJ's timings then: 0.86 us for a 12-module layer,
    19.8 us for a 64-expert MoE layer).
    """
    global _structure_generation
    shape = module.__dict__.get(_SHAPE)
    if shape is None:
        # A first call, or a copy or unpickled module: a copy drops its shape (see _Shape) but
        # carries the other caches, made for a tree it may have changed since behind the hooks.
        drop_caches(module)
    if shape is not None and shape.generation == _structure_generation:
        # A loop, not all() over a generator: run twice per layer call, and a generator costs
        # more to make than this loop does to run (NOTE [loops on the per-call path]).
        for ref, modules, children in shape.containers:
            m = ref()
            if m is None or m._modules is not modules or \
                    tuple(map(id, modules.values())) != children:
                break
        else:
            if not any(shape.childless):
                return
        _structure_generation += 1  # changed behind the hooks: every cache is stale
    tree = list(module.modules())
    _watch(tree)  # NOTE [only watched trees move the generation]
    module.__dict__[_SHAPE] = _Shape(_structure_generation, tree)


def structure_generation() -> int:
    """The current structure generation (a count of registered submodules and new buffer
    names, process-wide)."""
    return _structure_generation


def submodules_now(roots: Sequence[nn.Module], trees: Sequence[ModuleDicts], /
                   ) -> list[dict[str, Any]] | None:
    """``None`` when ``trees`` (read before a forward) are still ``roots``' current ones (the
    usual case: one lookup per root), else the ``__dict__`` of each submodule now (a forward
    that registered one, a lazy rotary cache module: NOTE [the replay runs the forward's
    submodules])."""
    for root, tree in zip(roots, trees):  # NOTE [loops on the per-call path]
        cached = root.__dict__.get(_DICTS)
        if cached is None or cached[0] != _structure_generation or cached[1] is not tree:
            return [m.__dict__ for root in roots for m in root.modules() if m is not root]
    return None


def changed_submodule(roots: Sequence[nn.Module], ran: Sequence[dict[str, Any]],
                      generation: int, /) -> tuple[str, str] | None:
    """NOTE [the replay runs the forward's submodules]: a submodule replaced, inserted or
    removed between a call's forward and its backward (``layer.act = nn.SiLU()``,
    ``layers[1].mlp = new_mlp``) would have the replay run another function than the one
    that ran, and silently give other gradients (eager backpropagates through the modules
    that ran). The forward's submodules are known (``ran``: the ``__dict__`` of each submodule
    of ``roots``, in order, as read before the forward, or after it when it registered one:
    ``submodules_now``; one it replaced is refused at the call); their objects are not kept,
    so they cannot be put back as parameter entries are: the replay refuses. ``None`` when
    ``roots``' trees are the ones that ran (the generation did not move: one compare per
    replay, and a tree check as at each call), else (path, what) of the first submodule that
    did not run, or ("", what) when one that ran is gone."""
    for root in roots:
        _check_structure(root)
    if _structure_generation == generation:
        return None
    ran_ids = {id(d) for d in ran}
    now: list[dict[str, Any]] = []
    for root in roots:
        prefix = "" if root is roots[0] else f"(argument {type(root).__name__})."
        for path, module in root.named_modules():
            if module is root:
                continue
            if id(module.__dict__) not in ran_ids:
                return f"{prefix}{path}", f"{type(module).__name__}, not the one the forward ran"
            now.append(module.__dict__)
    if len(now) != len(ran) or not all(map(operator.is_, now, ran)):
        return "", "a submodule the forward ran was removed or moved"
    return None


class ModuleDicts(NamedTuple):
    """The dicts of a module tree the boundary reads per call (dicts, not modules: no reference
    cycle, but for the rare submodule in ``flagged_otherwise``); cached on the root per
    structure generation. The dicts are the modules' own, read live: a buffer registered or
    reassigned since shows without a new cache."""

    parameters: tuple[dict[str, torch.Tensor | None], ...]  # each module's _parameters
    # Each module's _buffers, empty ones too: a buffer registered in the forward (lazily, at the
    # first call) lands in one, and must be watched like the others (NOTE [state the forward
    # changes] in state_changes.py).
    buffers: tuple[dict[str, torch.Tensor | None], ...]
    # Each submodule's __dict__ (for its training flag), without the root's own, which holds
    # this cache.
    submodules: tuple[dict[str, Any], ...]
    # Submodules whose training flag is not in their __dict__ (a property): read and set as
    # attributes.
    flagged_otherwise: tuple[nn.Module, ...] = ()
    # The __dict__ of each submodule not of one of torch.nn's own classes (NOTE [a number first
    # changed after the first replay] in forward_numbers.py).
    own: tuple[dict[str, Any], ...] = ()


def torch_nn_class(module: nn.Module, /) -> bool:
    """Whether ``module`` is of one of torch.nn's own classes (``nn.Linear``, ``nn.LayerNorm``),
    whose forwards rebind no plain attribute of theirs."""
    return type(module).__module__.startswith("torch.nn.modules.")


def module_dicts(module: nn.Module, /) -> ModuleDicts:
    """The dicts of ``module``'s tree, checked against its structure (call once per call)."""
    if not _hook_installed:
        watch_module_structure()
    _check_structure(module)
    key = _structure_generation
    cached = module.__dict__.get(_DICTS)
    if cached is None or cached[0] != key:
        tree = list(module.modules())
        # _parameters holds Parameters, or any tensor functional_call swaps in.
        cached = (key, ModuleDicts(tuple(m._parameters for m in tree),  # type: ignore[misc]
                                   tuple(m._buffers for m in tree),
                                   tuple(m.__dict__ for m in tree if m is not module),
                                   tuple(m for m in tree if m is not module and
                                         "training" not in m.__dict__),
                                   tuple(m.__dict__ for m in tree if m is not module and
                                         not torch_nn_class(m))))
        module.__dict__[_DICTS] = cached
    return cached[1]


def collect_parameters(trees: Sequence[ModuleDicts], skip: set[int], /, *,
                       frozen: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The trainable parameters of ``trees`` (deduplicated, without ids in ``skip``); the
    frozen ones go to ``frozen`` when given.

    Reading the cached ``_parameters`` dicts per call picks up parameters swapped in place
    (FSDP2, ``torch.func.functional_call``); the cache is rebuilt after any submodule is added
    or replaced (an adapter injected later).
    """
    found: list[torch.Tensor] = []
    for tree in trees:
        for params in tree.parameters:
            for param in params.values():
                if param is None:
                    continue
                key = id(param)  # once: about 360 instructions a call, per layer call
                if key in skip:
                    continue
                if param.requires_grad:
                    skip.add(key)
                    found.append(param)
                elif frozen is not None:
                    frozen.append(param)
    return found


def trainable_parameters(modules: Sequence[nn.Module], skip: set[int], /, *,
                         frozen: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """``collect_parameters`` of the trees of ``modules``."""
    return collect_parameters([module_dicts(m) for m in modules], skip, frozen=frozen)


def module_buffers(module: nn.Module, /) -> list[torch.Tensor]:
    """The buffers of ``module`` and its submodules, read now from cached ``_buffers`` dicts."""
    return [b for buffers in module_dicts(module).buffers for b in buffers.values()
            if b is not None]


def call_switches(spec: Any, leaves: Sequence[Any], /, *, hooked: tuple[int, ...],
                  only_tensors: bool) -> Any:
    """NOTE [verified per switch]: what a call says about the path its forward takes, other
    than through tensor values: the structure of its arguments (an optional tensor given or
    None), its flags (bools, strings, enums), and which user forward hooks run inside (their
    keys, ``hooked_modules``: a second hook added later counts as new). A
    module is verified (and its first calls' checks made) once per such key, not once in
    all: a block that uses a shared head only when told to (``use_head=True``) first reaches
    it at a later step, and its gradient would be lost there without an error; a hook added
    after the first step is warned about. Numbers are not part of it (a sequence length would
    make every step new), nor module attributes, and a module is verified for at most
    ``_MOST_SWITCHES`` of them (a request id among the arguments). The key is the hash (the
    sets it is looked up in then hash an int; two keys sharing a 64-bit hash would share a
    verification). A few microseconds a call with flags, a hash of the spec without."""
    if only_tensors:  # the usual layer call: nothing else to read
        if not hooked and POSITIONAL_CALL_SPECS.get(len(leaves)) is spec:
            # NOTE [fast paths] in tree.py: one spec object per count of positional tensors,
            # kept for good, so its keys are too (hashing a spec walks it: about 270 ns).
            key = _FAST_CALL_KEYS.get(len(leaves))
            if key is None:
                key = _FAST_CALL_KEYS[len(leaves)] = hash((spec, ()))
            return key
        return hash((spec, hooked))
    flags = [(i, leaf) for i, leaf in enumerate(leaves)
             if leaf is not None and (type(leaf) in _FLAGS or isinstance(leaf, enum.Enum))]
    try:
        return hash((spec, hooked, *flags))
    except TypeError:
        # An enum whose mixin type cannot hash (``class Mode(dict, Enum)``): by its class and
        # member name. (One key for all such calls made every member share the first's
        # verification: a table only another member's path reads lost its gradient silently.)
        return hash((spec, hooked, *[(i, (type(leaf), leaf.name) if isinstance(leaf, enum.Enum)
                                      else leaf) for i, leaf in flags]))


_FLAGS = (bool, str)
_FAST_CALL_KEYS: dict[int, int] = {}  # call_switches' keys of the fast-path specs, unhooked


def is_verified(module: nn.Module, switches: Any, /) -> bool:
    """Whether ``module``'s graph was checked (``foreign_leaves``) for calls with ``switches``
    since its tree last changed (NOTE [verified per switch]), and no plain tensor attribute
    that was frozen then requires grad now (NOTE [attributes unfrozen after the check])."""
    verified = module.__dict__.get(_VERIFIED)
    if verified is None or verified[0] != _structure_generation or \
            not (switches in verified[1] or len(verified[1]) >= _MOST_SWITCHES):
        return False
    if verified[2] and _unfrozen(verified[2]):
        module.__dict__[_VERIFIED] = (_structure_generation, set(), ())
        return False
    return True


# A module called with a new string each call (a request id) would be verified at every call,
# and remember every key: after this many, new switches count as verified.
_MOST_SWITCHES = 64


def ever_verified(module: nn.Module, /) -> bool:
    """Whether ``module``'s graph was checked for any call since its tree last changed."""
    verified = module.__dict__.get(_VERIFIED)
    return verified is not None and verified[0] == _structure_generation


def mark_verified(module: nn.Module, switches: Any, /) -> None:
    verified = module.__dict__.get(_VERIFIED)
    if verified is None or verified[0] != _structure_generation or not verified[1]:
        module.__dict__[_VERIFIED] = verified = (_structure_generation, set(),
                                                 _frozen_attributes(module))
    verified[1].add(switches)


# NOTE [attributes unfrozen after the check]: a leaf tensor that requires grad, held by a
# module as a plain attribute (not a parameter), is no input of the boundary, so a module's
# first replay refuses it (``foreign_leaves``). One frozen then and made to require grad later
# (DARTS's architecture weights held as plain tensors, unfrozen after a warm-up: helper OY)
# was never seen again: the module was verified, and its gradient was lost, silently. So the
# check notes the attributes holding frozen leaf tensors (directly, or as entries of a list,
# tuple or dict of at most 64), by name and entry, and ``is_verified`` looks at those entries
# again at each replay: one that requires grad now makes the next replays check again (it is
# refused, naming the attribute). Only the entries frozen then: a dict holding one tensor
# unfrozen beside a frozen one would be checked again at every replay (helper PB). A few dict
# reads a replay, for modules that hold such tensors. The submodules are held strongly (they
# are the module's own; a weak reference made the module unpicklable: torch.save(model)).
_Frozen = tuple[nn.Module, str, tuple[Any, ...]]


def _frozen_attributes(module: nn.Module, /) -> tuple[_Frozen, ...]:
    found = []
    for sub in module.modules():
        for name, value in tuple(vars(sub).items()):
            if name in _NOT_ATTRIBUTES or name.startswith("_pytree_ckpt"):
                continue
            keys = tuple(key for key, t in _entries(value)
                         if not t.requires_grad and t.grad_fn is None)
            if keys:
                found.append((sub, name, keys))
    return tuple(found)


_NOT_ATTRIBUTES = frozenset(("_parameters", "_buffers", "_modules"))


def _entries(value: Any, /) -> list[tuple[Any, torch.Tensor]]:
    """The tensors of an attribute's value, by entry (``None`` for the value itself)."""
    if isinstance(value, torch.Tensor):
        return [(None, value)]
    items = value.items() if isinstance(value, dict) else \
        enumerate(value) if isinstance(value, (list, tuple)) else ()
    # A larger container (a cache of every step's tensors) would cost each replay its length.
    return [(k, t) for k, t in items if isinstance(t, torch.Tensor)] \
        if items and len(value) <= 64 else []


def _unfrozen(attributes: Sequence[_Frozen], /) -> bool:
    for sub, name, keys in attributes:
        value = sub.__dict__.get(name)
        if value is None:
            continue
        for key in keys:
            # Read without side effects: a defaultdict's missing key is not made (helper PF).
            t = value if key is None else value.get(key) if isinstance(value, dict) else \
                value[key] if isinstance(value, (list, tuple)) and type(key) is int and \
                0 <= key < len(value) else None
            if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is None:
                return True
    return False


def foreign_leaves(outs: list[torch.Tensor], known: Sequence[torch.Tensor], /
                   ) -> list[torch.Tensor]:
    """The leaves that require grad, reached from ``outs``, that are not one of ``known``. The
    walk stops at a known tensor with a graph of its own (a fast weight ``functional_call``
    swapped in, computed from the parameters: its gradient is returned, and autograd carries it
    on)."""
    known_ids = {id(t) for t in known}
    seen: set[Any] = {t.grad_fn for t in known if t.grad_fn is not None}
    stack = [o.grad_fn for o in outs if o.grad_fn is not None]
    found = []
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None and id(variable) not in known_ids:
            found.append(variable)
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return found


def graph_reaches(nodes: Iterable[Any], target: Any, /, *, most: int = 10_000) -> bool:
    """Whether the autograd graph below ``nodes`` holds ``target``: a node, or a tensor (its
    node, or the leaf a node accumulates into), searched through ``most`` nodes at most (for
    refusals and their messages: a rare path)."""
    node = target.grad_fn if isinstance(target, torch.Tensor) else target
    stack = list(nodes)
    seen: set[Any] = set()
    while stack and len(seen) < most:
        current = stack.pop()
        if current is None or current in seen:
            continue
        seen.add(current)
        if (node is not None and current is node) or \
                getattr(current, "variable", None) is target:
            return True
        stack.extend(n for n, _ in current.next_functions)
    return False


_WARNED_HOOKS = "_pytree_ckpt_warned_hooks"


def warn_forward_hooks(owner: nn.Module, passed: Sequence[nn.Module] = (), /, *,
                       own: bool = False) -> None:
    """Warn about forward hooks inside the boundary (the boundary calls this once per module
    and structure, at its first replay); ``own``: the module's own hooks run inside it too;
    ``passed``: modules passed as arguments, whose own hooks run inside when ``fn`` calls them.

    Such a hook (a forward pre-hook too) runs in the original pass, under no-grad, and again in
    the replay, in backward. The module inputs and output it receives leave the boundary with
    their gradients (NOTE [hooked outputs leave with gradients] in hook_outputs.py), but a tensor
    it computes from them under no-grad does not, and a loss built from it is silently wrong;
    torch's reentrant checkpoint loses both. Hooks of torch and of this library only read or
    rewrite; transformers' output capturing hook keeps the output as it is: neither is warned
    about.
    """
    def user_hooks(hooks: Any, sub: nn.Module | None = None) -> list[str]:
        names = []
        for hook in hooks.values():
            if is_library_hook(hook) or keeps_output_as_is(hook) or _pruning_method(hook) or \
                    sub is not None and isinstance(
                        named := dunder(hook, "name", dunder(hook, "_tensor_name")), str) and \
                    isinstance(sub.__dict__.get(named), torch.Tensor):
                # (A pruning method of the user's, a BasePruningMethod subclass, computes
                # its attribute from parameters and buffers, taken as the call's inputs:
                # NOTE [only attributes a pre-hook names]; helper OJ: warned falsely. So
                # does a pre-hook of the user's naming the tensor attribute it sets there,
                # helper PD; not one whose name is only for display, helper PG, nor one whose
                # attribute holds no tensor yet, a None placeholder: whether it will cannot be
                # told before it runs, and a hook removed before backward is not asked again,
                # helper PI.)
                continue
            fn = hook.func if isinstance(hook, functools.partial) else hook
            names.append(dunder(fn, "__qualname__", type(fn).__qualname__))
        return names

    def module_hooks(sub: nn.Module) -> list[str]:  # pre-hooks run there too, first
        return user_hooks(sub._forward_pre_hooks, sub) + user_hooks(sub._forward_hooks)

    found = [f"{name or '(itself)'}: {hook}" for name, sub in owner.named_modules()
             if own or sub is not owner
             for hook in module_hooks(sub)]
    inside = {id(m) for m in owner.modules()}
    for module in passed:
        found += [f"(argument {type(module).__name__}){'.' + name if name else ''}: {hook}"
                  for name, sub in module.named_modules() if id(sub) not in inside
                  for hook in module_hooks(sub)]
        inside.update(id(m) for m in module.modules())
    global_hooks = [f"(global): {hook}"
                    for hook in user_hooks(nn.modules.module._global_forward_hooks)]
    found += global_hooks
    told = owner.__dict__.get(_WARNED_HOOKS)
    if found and (told is None or told.what != found):  # a new switch: said once
        owner.__dict__[_WARNED_HOOKS] = Told(found)  # a copy is told anew
        # Global hooks (register_module_forward_hook) are on no module: nothing records the
        # outputs they receive (NOTE [hooked outputs leave with gradients]).
        unrecorded = (" Global forward hooks are not recorded: an output a global hook keeps "
                      "has no gradient either; register it on the module instead."
                      if global_hooks else "")
        warnings.warn(
            f"pytree_ckpt: forward hooks inside the checkpointed {type(owner).__name__} run "
            f"under no-grad in the original pass and again in backward: {', '.join(found)}. The "
            "module inputs and output such a hook receives leave the boundary with their "
            "gradients, but a tensor the hook computes from them has none, and a loss built "
            "from that is wrong; a hook that only reads, rewrites or keeps them as they are is "
            "fine (not one that keeps what an earlier hook rewrote: only what the module "
            f"itself received and returned is recorded).{unrecorded} Tip: keep the module "
            "input or output itself in the hook and "
            "compute from it after the layer's call, or return such values as outputs of the "
            "layer (any PyTree); once your hooks are such, silence this with "
            "warnings.filterwarnings(\"ignore\", message=\"pytree_ckpt: forward hooks "
            "inside\") (docs/boundary.md, 'Forward hooks inside a layer').",
            stacklevel=user_stacklevel())


def _pruning_method(hook: Any, /) -> bool:
    """Whether ``hook`` is a ``torch.nn.utils.prune`` pruning method (of a subclass of the
    user's too); that module imported only where one exists."""
    prune = sys.modules.get("torch.nn.utils.prune")
    return prune is not None and isinstance(hook, prune.BasePruningMethod)


def any_expanded(trees: Sequence[ModuleDicts], /) -> bool:
    """Whether a parameter of ``trees`` is one of torch's ``ExpandedWeight`` (per-sample
    gradients: ``call_for_per_sample_grads`` swaps them in for one call); that module is
    looked up only where it was imported."""
    impl = sys.modules.get("torch.nn.utils._expanded_weights.expanded_weights_impl")
    return impl is not None and any(isinstance(t, impl.ExpandedWeight) for tree in trees
                                    for d in tree.parameters for t in d.values())


def any_lazy(trees: Sequence[ModuleDicts], /) -> bool:
    """Whether a parameter or buffer of ``trees`` is still uninitialized (a lazy module's)."""
    return any(t is not None and is_lazy(t) for tree in trees
               for d in (*tree.parameters, *tree.buffers) for t in d.values())


def graph_attributes(module: nn.Module, /) -> list[tuple[str, torch.Tensor]]:
    """The plain tensor attributes (in ``module``'s own ``__dict__``), with a graph or without
    one, which its own forward pre-hooks set each call (NOTE [attributes set before the call]
    in boundary.py).

    NOTE [only attributes a pre-hook names]: an attribute is taken only when a pre-hook says it
    sets it: ``weight_norm``'s and ``spectral_norm``'s hook objects by ``name``, pruning
    methods by ``_tensor_name``. Any other graph tensor there is left alone: a forward hook
    that keeps the module's output (``module.last = output``) leaves one whose graph the
    step's backward frees, and taken as an input of the next call it made that backward run
    into the freed graph ("backward through the graph a second time").
    """
    names = {name for hook in module._forward_pre_hooks.values()
             if isinstance(name := dunder(hook, "name", dunder(hook, "_tensor_name")),
                           str)}
    if not names:
        return []
    held = module.__dict__
    return [(name, value) for name in names if isinstance(value := held.get(name), torch.Tensor)]
