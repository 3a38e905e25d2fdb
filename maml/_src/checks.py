"""Argument checks shared by the public API: each error names the argument, the value and the fix."""

from __future__ import annotations

import contextlib
import difflib
import math
import warnings
from collections.abc import Collection, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import _WeightNorm
from torch.nn.utils.weight_norm import WeightNorm

from .batch import TENSORS


def close_matches(word: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest choices, or an empty string."""
    matches = difflib.get_close_matches(word, list(choices), n=3, cutoff=0.6)
    return f" (did you mean {' or '.join(repr(m) for m in matches)}?)" if matches else ""


def one_of(arg: str, value: Any, choices: tuple[Any, ...]) -> None:
    if value not in choices:
        hint = close_matches(value, [c for c in choices if isinstance(c, str)]) if isinstance(value, str) else ""
        raise ValueError(f"{arg}={value!r} is not supported{hint}; choose one of {', '.join(map(repr, choices))}.")


def update_rule(rule: Any, options: Any) -> None:
    """Checks an ``inner_optimizer`` given as an object: the ``UpdateRule`` contract, and no name's options."""
    missing = [m for m in ("init", "update") if not callable(getattr(rule, m, None))]
    if missing:
        raise TypeError(
            f"inner_optimizer={rule!r} is neither a rule's name (maml.INNER_OPTIMIZERS: 'sgd', 'adam', ...) nor an update rule: "
            f"it has no {' or '.join(missing)} method; see maml.UpdateRule for the contract."
        )
    if options is not None:
        raise ValueError(
            f"inner_optimizer_options={options!r} configure a rule given by name; inner_optimizer is a "
            f"{type(rule).__name__} object: give it its options instead."
        )


def integer(arg: str, value: Any, minimum: int, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{arg} must be an int, got {value!r} ({type(value).__name__}).")
    if value < minimum:
        raise ValueError(f"{arg}={value} is out of range; it must be >= {minimum}.")


def positive_number(arg: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{arg} must be a Python float, got {value!r} ({type(value).__name__}); to learn it, pass "
            f"the initial value as a float and learn_inner_lr='scalar' or 'per_parameter'."
        )
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{arg}={value} is out of range; it must be a finite number > 0.")


def input_dtype(arg: str, x: Tensor, dtype: torch.dtype, integer_ok: bool) -> None:
    """Inputs must be floating point in the parameters' dtype (integers only for embedding models)."""
    if x.is_floating_point() or x.is_complex():
        if x.dtype != dtype:
            raise TypeError(
                f"{arg} has dtype {x.dtype} but the model's parameters are {dtype}; convert the inputs "
                f"with {arg}.to({dtype}) (or TaskBatch.to({dtype})), or the model with model.to({x.dtype})."
            )
    elif not integer_ok:
        raise TypeError(
            f"{arg} has dtype {x.dtype}, but the model needs floating-point inputs ({dtype}); convert "
            f"them with {arg}.to({dtype}) (images stored as uint8 also need scaling, e.g. x.to({dtype}) / 255)."
        )


def parameter_names(arg: str, params: dict[str, Tensor], model: nn.Module) -> None:
    """``params`` must hold exactly the model's parameters, keyed by ``named_parameters()`` name."""
    expected = dict(model.named_parameters())
    unknown = [k for k in params if k not in expected]
    if unknown:
        hints = "; ".join(f"{k!r}{close_matches(k, expected)}" for k in unknown)
        raise ValueError(
            f"{arg} has keys that are not parameters of the model: {hints}. Key it by "
            f"dict(model.named_parameters()) names."
        )
    missing = [k for k in expected if k not in params]
    if missing:
        raise ValueError(
            f"{arg} lacks parameters of the model: {', '.join(map(repr, missing))}. Pass every parameter, "
            f"e.g. {{**dict(model.named_parameters()), **overrides}}."
        )
    for k, p in params.items():
        if p.shape != expected[k].shape:
            raise ValueError(
                f"{arg}[{k!r}] has shape {tuple(p.shape)} but the model's parameter has shape "
                f"{tuple(expected[k].shape)}; pass one task's parameters, without a task dimension."
            )


def no_running_stats(model: nn.Module) -> None:
    """Norm layers that update running statistics in training mode cannot be adapted functionally."""
    for name, m in model.named_modules():
        if m.training and getattr(m, "track_running_stats", False) and getattr(m, "running_mean", None) is not None:
            raise ValueError(
                f"{type(m).__name__} {name!r} is in training mode and tracks running statistics: it would "
                f"overwrite them in place on every inner step of every task (and vmap cannot batch that). "
                f"Build it with track_running_stats=False, the MAML convention of normalizing every task "
                f"with its own batch statistics, or call model.eval() to normalize with the fixed running "
                f"statistics."
            )


SEVERAL_DEVICES = (
    "To use several devices, run one process per device under torchrun and give each its share of the "
    "meta-batch's tasks: maml.shard(batch), then maml.all_reduce_grads(learner.parameters()) after backward "
    "(docs/experiments.md, 'Several processes and machines (torchrun)')."
)


def not_data_parallel(arg: str, model: nn.Module) -> None:
    """Refuses an ``nn.DataParallel`` as the model or inside it, naming its ``.module`` and the toolkit's way.

    ``torch.func.functional_call``, which runs every task's forward pass at its fast weights, refuses
    an ``nn.DataParallel`` model ("The stateless API can't be used with nn.DataParallel module"),
    but only at the first call: the check here says so at construction. Inside the model it would
    split one task's few examples across GPUs at every inner step (on one device it does nothing),
    so it is refused too: the toolkit spreads tasks, not examples, across devices.
    """
    if isinstance(model, nn.DataParallel):
        raise TypeError(
            f"{arg}=nn.DataParallel({module_kind(model.module)}) cannot be meta-learned: torch.func's "
            f"functional_call, which runs each task at its fast weights, refuses nn.DataParallel. Pass "
            f"{arg}.module, the network it wraps. {SEVERAL_DEVICES}"
        )
    for name, sub in model.named_modules():
        if name and isinstance(sub, nn.DataParallel):
            raise TypeError(
                f"{arg}'s submodule {name!r} is an nn.DataParallel({module_kind(sub.module)}), which would split "
                f"each task's few examples across GPUs at every inner step (on one device it does nothing): put "
                f"its .module in its place ({arg}.get_submodule({name!r}).module). {SEVERAL_DEVICES}"
            )


def module_kind(module: nn.Module) -> str:
    """The class a user would name a module by: ``Linear`` for a parametrized one (``ParametrizedLinear``)."""
    cls = type(module).__bases__[0] if parametrize.is_parametrized(module) else type(module)
    return cls.__name__


def warn_weight_norm(model: nn.Module, mode: str, hessian: bool) -> None:
    """Warns that ``weight_norm`` layers make the exact modes inexact: PyTorch's second derivative of it is wrong.

    ``torch._weight_norm``, which both ``torch.nn.utils.parametrizations.weight_norm`` and the
    older hook-based ``torch.nn.utils.weight_norm`` call, fails ``torch.autograd.gradgradcheck``
    (the derivative of its fused backward is wrong), so a meta-gradient through it is off by tens
    of percent; the same norm in plain torch ops is exact (tests/engine/test_model_support.py).
    ``hessian``: the mode takes second derivatives (``modes.Paths``); else there is nothing to warn of.
    """
    if not hessian:
        return
    found = []
    for name, m in model.named_modules():
        if parametrize.is_parametrized(m):
            for tensor, chain in m.parametrizations.items():
                if any(isinstance(p, _WeightNorm) for p in chain):
                    found.append(f"the {tensor!r} of {module_kind(m)} {name!r}")
        for hook in m._forward_pre_hooks.values():
            if isinstance(hook, WeightNorm):
                found.append(f"the {hook.name!r} of {module_kind(m)} {name!r}")
    if found:
        warnings.warn(
            f"weight_norm normalizes {' and '.join(found)}, but PyTorch's second derivative of it is wrong "
            f"(torch._weight_norm fails torch.autograd.gradgradcheck), so mode={mode!r} gives inexact "
            f"meta-gradients through it. Use mode='first_order', or write the norm in plain torch ops, e.g. "
            f"weight = g * v / v.norm(dim=1, keepdim=True) for a Linear layer, which are exact.",
            UserWarning,
            stacklevel=3,
        )


def grad_mode_possible(method: str) -> None:
    """The inner loop differentiates the support loss, which ``torch.inference_mode()`` forbids."""
    if torch.is_inference_mode_enabled():
        raise RuntimeError(
            f"MetaLearner.{method} cannot run under torch.inference_mode(): the inner loop differentiates the "
            f"support loss, which inference mode forbids even inside torch.enable_grad(). Evaluate under "
            f"torch.no_grad() instead, which gives the same values without keeping a graph."
        )


def one_task(support_x: Tensor, seen: torch.Size | None) -> None:
    """``support_x`` of ``adapt`` must be one task: refuses ``(T, n, *x_shape)`` when the examples' shape is known.

    A model that broadcasts over leading dimensions (an MLP) takes a whole batch as one task of
    ``T`` examples without complaint; only the shape of the examples the learner saw before
    (``seen``, from earlier calls) tells the two apart.
    """
    if seen is not None and support_x.shape[1:] != seen and support_x.shape[2:] == seen:
        tasks, n = support_x.shape[:2]
        raise ValueError(
            f"support_x has shape {tuple(support_x.shape)}: a batch of {tasks} tasks of {n} examples shaped "
            f"{tuple(seen)}, the shape of the examples this learner saw before, but adapt takes one task, "
            f"(n, *x_shape). Pass one task (support_x[t], support_y[t]), or use "
            f"learner.run(maml.TaskBatch(...)) for every task."
        )


class _EvaluationLoss(Tensor):
    """A loss computed under ``torch.no_grad()``: an ordinary tensor whose ``backward()`` says why it has no graph.

    Grad mode off records no graph, so no tensor made under it can carry a node whose backward
    raises; a subclass can answer ``loss.backward()`` itself. Every operation on it returns an
    ordinary tensor (the subclass does not propagate), it prints and saves as one, and it does
    not require grad, so evaluation code sees no difference.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    def backward(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        if self.requires_grad:  # made a leaf by hand: an ordinary backward
            return self.as_subclass(Tensor).backward(*args, **kwargs)
        raise RuntimeError(
            "this meta-loss was computed under torch.no_grad(), which records no graph, "
            "so it has no meta-gradient to backpropagate; call learner.meta_loss(batch) with grad mode "
            "on to train, and keep torch.no_grad() for evaluation."
        )

    def __repr__(self, *args: Any, **kwargs: Any) -> str:
        return self.as_subclass(Tensor).__repr__(*args, **kwargs)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.as_subclass(Tensor).__reduce_ex__(protocol)


def evaluation_loss(loss: Tensor) -> Tensor:
    """``loss``, computed without a graph, as a tensor whose ``backward()`` says so."""
    return loss.as_subclass(_EvaluationLoss)


def adapt_set(adapt: Any, model: nn.Module) -> list[str]:
    """The names of the parameters the inner loop updates, from ``adapt`` (names, a predicate or ``None``)."""
    params = dict(model.named_parameters())
    trainable = [k for k, p in params.items() if p.requires_grad]
    if adapt is None:
        names = trainable
    elif callable(adapt):
        names = [k for k in trainable if adapt(k)]
        if not names:
            raise ValueError(
                f"adapt={adapt!r} selects none of the model's trainable parameters "
                f"({', '.join(map(repr, trainable[:6]))}{', ...' if len(trainable) > 6 else ''}); "
                f"it is called with each named_parameters() name and must return True for those to adapt."
            )
    elif isinstance(adapt, (list, tuple, set, frozenset)) and all(isinstance(k, str) for k in adapt):
        unknown = [k for k in adapt if k not in params]
        if unknown:
            hints = "; ".join(f"{k!r}{close_matches(k, params)}" for k in unknown)
            raise ValueError(f"adapt names parameters the model does not have: {hints}. Use named_parameters() names.")
        frozen = [k for k in adapt if not params[k].requires_grad]
        if frozen:
            raise ValueError(
                f"adapt names {', '.join(map(repr, frozen))}, which has requires_grad=False; the inner loop "
                f"differentiates with respect to what it adapts: set requires_grad=True or leave it out of adapt."
            )
        names = [k for k in params if k in set(adapt)]  # the model's order, whatever the list's
        if not names:
            raise ValueError("adapt=[] adapts nothing; name at least one parameter, or pass None to adapt every one.")
    else:
        raise TypeError(
            f"adapt must be a list of parameter names, a predicate name -> bool, or None, got {adapt!r} "
            f"({type(adapt).__name__})."
        )
    if not names:
        raise ValueError("model has no parameter with requires_grad=True: there is nothing to adapt.")
    return names


def step_weights(weights: Any, steps: int, like: Tensor, *, compiled: bool = False) -> Tensor:
    """``weights`` as a ``(steps,)`` tensor in ``like``'s dtype and device, or an error that says what is expected.

    ``compiled``: the call runs the compiled step, which differentiates the meta-parameters only.
    """
    if not isinstance(weights, Tensor):
        raise TypeError(
            f"step_weights must be a tensor of shape ({steps},), one weight per inner step, got {weights!r}."
        )
    if weights.shape != (steps,) or steps == 0:
        raise ValueError(
            f"step_weights has shape {tuple(weights.shape)} but this call takes {steps} inner steps: pass a "
            f"tensor of shape ({steps},), the weight of the query loss after each step."
            + (" With steps=0 there is no step to weigh; drop step_weights." if steps == 0 else "")
        )
    if not weights.is_floating_point():
        raise TypeError(f"step_weights must be floating point, got {weights.dtype}.")
    if compiled and weights.requires_grad:
        raise ValueError(
            "step_weights require grad, but with compile=True the compiled step differentiates the "
            "meta-parameters only and they would get no gradient; pass step_weights.detach(), or build "
            "the learner with compile=False to learn them."
        )
    return weights.to(dtype=like.dtype, device=like.device)


def examples(support: int, query: int | None, steps: int) -> None:
    """Refuses an empty query set, and an empty support set where the inner loop takes a step (sizes a task)."""
    if query == 0:
        raise ValueError(
            "the batch's query set is empty (query_x has 0 examples a task), so there is no meta-loss to "
            "compute; give each task at least one query example."
        )
    if steps and support == 0:
        raise ValueError(
            f"the batch's support set is empty (support_x has 0 examples a task), so the inner loop has no "
            f"loss to take {steps} step(s) on; give each task support examples, or pass steps=0."
        )


def still_trainable(params: dict[str, Tensor]) -> None:
    """Refuses adapted parameters frozen (``requires_grad_(False)``) after the learner was built."""
    frozen = [name for name, p in params.items() if not p.requires_grad]
    if frozen:
        raise ValueError(
            f"the parameter(s) {', '.join(map(repr, frozen))} were frozen (requires_grad=False) after the "
            f"learner was built, which adapts them; build the MetaLearner after freezing (frozen parameters are "
            f"then used as they are), or unfreeze them."
        )


def differentiable(
    mode: str,
    compiled: bool,
    batch: Any,
    consts: Mapping[str, Tensor],
    names: Collection[str],
    *,
    inputs: bool,
    all_adapted: str | None,
    closes_over: bool = False,
) -> None:
    """Refuses what a mode's meta-gradient cannot reach: inputs on a graph, a tensor on a graph the inner loss closes
    over, parameters it never moves.

    ``inputs``: the mode backpropagates into inputs that require grad, through the inner loop's whole autograd
    graph, which reaches what the inner loss reads from outside its arguments too (``closes_over``);
    ``all_adapted``: why it needs every trainable parameter adapted (it moves only adapted ones), or ``None``
    (``modes.Paths``).
    """
    path = "compile=True" if compiled else f"mode={mode!r}"
    if closes_over and (compiled or not inputs):
        raise ValueError(
            f"inner_loss_fn reads a tensor that requires grad and is none of its arguments (a tensor it closes "
            f"over), and {path} differentiates only what the learner passes it: that tensor would get no "
            f"meta-gradient. Keep it in the model as a parameter outside adapt= and read it from the inner loss's "
            f"params= keyword (every mode differentiates it), or use mode='second_order' or 'first_order' without "
            f"compile."
        )
    if compiled or not inputs:
        graphed = [k for k in TENSORS if getattr(batch, k).requires_grad]
        if graphed:
            raise ValueError(
                f"batch.{graphed[0]} requires grad (it comes from a graph, e.g. an encoder upstream of the "
                f"learner), but {path} does not backpropagate into the inputs: the encoder would get no "
                f"gradient. Use mode='second_order' or 'first_order' without compile, which do, or detach "
                f"the inputs if the encoder is not to be trained through the learner."
            )
    if all_adapted is not None:
        unadapted = sorted(k for k, v in consts.items() if v.requires_grad and k in names)
        if unadapted:
            raise ValueError(
                f"mode={mode!r} needs every trainable parameter adapted ({all_adapted}); "
                f"{', '.join(unadapted)} is trained but not adapted, and would never change: adapt it, or "
                f"freeze it with requires_grad_(False)."
            )


def key_differences(expected: Iterable[str], got: Iterable[str]) -> str:
    """``"missing 'a'; unexpected 'b'"``: the keys of ``expected`` not in ``got`` and the reverse ("" if none)."""
    expected, got = list(expected), list(got)
    missing, extra = [k for k in expected if k not in got], [k for k in got if k not in expected]
    parts = [
        f"{what} {', '.join(map(repr, keys))}" for what, keys in (("missing", missing), ("unexpected", extra)) if keys
    ]
    return "; ".join(parts)


def same_rule(saved: Any, mine: Mapping[str, Any]) -> None:
    """The rule a state was saved with (``state['inner_optimizer']``) must be ``mine``: its class, then its learned
    options; else a ValueError naming both and how to build the learner that loads it."""
    if (
        not isinstance(saved, Mapping)
        or not isinstance(saved.get("class"), str)
        or not isinstance(saved.get("learned"), (list, tuple))
    ):
        raise ValueError(
            f"state['inner_optimizer'] is {saved!r}; it must be what MetaLearner.state_dict() saves, e.g. "
            f"{{'class': 'RMSprop', 'module': 'maml._src.optimizers', 'learned': ['alpha']}}: load a state_dict "
            f"a learner saved."
        )
    theirs, ours = saved["class"], mine["class"]
    if theirs != ours:
        build = f"maml.{theirs}(...)" if str(saved.get("module", "")).startswith("maml.") else f"{theirs}(...)"
        raise ValueError(
            f"this state was saved by a learner with inner_optimizer={theirs}; this learner's is {ours}: build it "
            f"with {build} or load a state saved by {ours}."
        )
    if sorted(saved["learned"]) != list(mine["learned"]):
        raise ValueError(
            f"this state's {theirs} learned {sorted(saved['learned'])}, but this learner's {ours} learns "
            f"{list(mine['learned'])}: build it with learn={sorted(saved['learned'])} (in inner_optimizer_options "
            f"or the rule's own argument) or load a state saved by a {ours} that learns those."
        )


def same_tensors(what: str, saved: Any, mine: Mapping[str, Tensor], build: str) -> None:
    """``saved`` must hold the keys and shapes of ``mine``; else one ValueError naming the entry and both sides."""
    if not isinstance(saved, Mapping):
        raise ValueError(
            f"{what} is a {type(saved).__name__}; it must be a dict name -> tensor, as state_dict() saves."
        )
    if differences := key_differences(mine, saved):
        raise ValueError(
            f"{what} does not match this learner: {differences}. Build the learner with {build} as the saved one."
        )
    for k, t in mine.items():
        s = saved[k]
        if not isinstance(s, Tensor) or s.shape != t.shape:
            got = tuple(s.shape) if isinstance(s, Tensor) else type(s).__name__
            raise ValueError(
                f"{what}[{k!r}] is {got} but this learner's is {tuple(t.shape)}; build the learner with {build} "
                f"as the saved one."
            )


def one_task_support(support_x: Any, support_y: Any, example_shape: torch.Size | None, per_step: bool) -> None:
    """``adapt``'s support set: tensors of one task's examples, one target per input (``per_step``: one set a step)."""
    least, form = (2, "(S, n, ...)") if per_step else (1, "(n, ...)")
    for name, t in (("support_x", support_x), ("support_y", support_y)):
        if not isinstance(t, Tensor) or t.ndim < least:
            raise TypeError(f"{name} must be a tensor of one task's examples, {form}, got {t!r}.")
    if per_step and support_x.shape[0] != support_y.shape[0]:
        raise ValueError(
            f"support_x has {support_x.shape[0]} inner steps' sets but support_y has {support_y.shape[0]}; "
            f"per_step=True needs one target set per input set."
        )
    x, y = (support_x[0], support_y[0]) if per_step else (support_x, support_y)
    if x.shape[0] != y.shape[0]:
        raise ValueError(
            f"support_x has {x.shape[0]} examples but support_y has {y.shape[0]}; every input needs exactly one target."
        )
    one_task(x, example_shape)


@contextlib.contextmanager
def batch_hint(support_x: Tensor, seen: torch.Size | None) -> Iterator[None]:
    """Adds to a model's error on ``adapt``'s first call, before any shape was seen, that a batch may be the cause.

    Before a first call no shape tells one task ``(n, *x_shape)`` from a batch ``(T, n, *x_shape)``
    (:func:`one_task`); a batch given then fails in the model's first layer with its own message.
    """
    try:
        yield
    except RuntimeError as e:
        if seen is not None or support_x.ndim < 3:
            raise
        raise ValueError(
            f"the model failed on support_x of shape {tuple(support_x.shape)}: {str(e).splitlines()[0]} adapt takes "
            f"one task, (n, *x_shape); if this is a batch of {support_x.shape[0]} tasks of {support_x.shape[1]} "
            f"examples, pass one task (support_x[t], support_y[t]), or use learner.run(maml.TaskBatch(...)) for "
            f"every task."
        ) from e


def placed_like(rates: Mapping[str, Tensor], first: Tensor, rule_prefix: str) -> None:
    """The learnable rates and a rule's tensors must be on the parameters' device, in their dtype."""
    for name, rate in rates.items():
        if rate.device != first.device or rate.dtype != first.dtype:
            what = (
                f"the rule's tensor {name!r}" if name.startswith(rule_prefix) else f"the learnable inner rate {name!r}"
            )
            raise ValueError(
                f"{what} is {rate.dtype} on {rate.device} but the model's parameters are {first.dtype} on "
                f"{first.device}; move both with learner.to(...) instead of model.to(...)."
            )


def learner_state(
    state: Any,
    model_state: Mapping[str, Tensor],
    rates: Mapping[str, Tensor],
    rule: nn.Module | None,
    rule_name: str,
    identity: Mapping[str, Any] | None = None,
) -> None:
    """What ``MetaLearner.load_state_dict`` loads must be what a learner built like this one saved, all of it.

    ``identity``: this learner's rule as ``state.rule_identity`` records it. Where both sides hold a rule's
    own tensors, the saved rule (``state['inner_optimizer']``) must be this one: the same class and learned
    options (where one side alone holds them, that is refused first). A state saved before the rule was
    recorded loads where its tensors match; two rules with fixed options keep nothing of the rule in the
    state, so a state of one loads into a learner of the other (the model's weights, under another rule).

    Raises:
        ValueError: naming the entry and both sides (another model, ``learn_inner_lr``, steps of per-step
            rates, or rule).
    """
    if not isinstance(state, Mapping) or not {"model", "inner_lrs"} <= set(state):
        raise ValueError(
            f"state must be what MetaLearner.state_dict() returned (keys 'model', 'inner_lrs', 'batching'), "
            f"got {type(state).__name__}{f' with keys {sorted(state)}' if isinstance(state, Mapping) else ''}."
        )
    if set(state["inner_lrs"]) != set(rates):
        raise ValueError(
            f"state['inner_lrs'] has rates {sorted(state['inner_lrs'])} but this learner learns "
            f"{sorted(rates)}; build it with the same learn_inner_lr as the saved one."
        )
    saved_rule = state.get("inner_optimizer")  # absent from states saved before the rule was recorded
    if rule is None and "rule" in state:
        example = saved_rule["class"] if isinstance(saved_rule, Mapping) and "class" in saved_rule else "MetaCurvature"
        raise ValueError(
            f"state holds a rule's own tensors (state['rule']: {sorted(state['rule'])}), but this learner's "
            f"rule {rule_name!r} "
            f"has none; build it with the same inner_optimizer as the saved one (e.g. maml.{example}(...))."
        )
    if rule is not None and "rule" not in state:
        raise ValueError(
            f"state has no 'rule' entry, but this learner's rule {rule_name} is a module "
            f"with a state of its own; load a state_dict saved by a learner with the same rule."
        )
    if rule is not None and identity is not None and saved_rule is not None:
        same_rule(saved_rule, identity)  # before the tensors: another rule's may have the same keys and shapes
    chosen = state.get("batching", {})  # what batching="auto" chose, by device: {"cpu": "vmap"}
    if not isinstance(chosen, Mapping):
        raise ValueError(
            f"state['batching'] must map devices to 'vmap' or 'loop', e.g. {{'cpu': 'vmap'}}, got {chosen!r}."
        )
    for device, batching in chosen.items():
        try:
            torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(
                f"state['batching'] names the device {device!r}, which torch does not know; it maps devices such "
                f"as 'cpu' or 'cuda:0' to 'vmap' or 'loop': load a state_dict a learner saved."
            ) from None
        if batching not in ("vmap", "loop"):
            raise ValueError(
                f"state['batching'][{device!r}] is {batching!r}; it must be 'vmap' or 'loop' (what batching='auto' "
                f"chose): load a state_dict a learner saved."
            )
    plans = state.get("plans", {})  # what the memory planner measured, by configuration
    if not isinstance(plans, Mapping) or not all(
        isinstance(k, str) and isinstance(v, Mapping) for k, v in plans.items()
    ):
        raise ValueError(
            f"state['plans'] must map configurations to measured bytes, as MetaLearner.state_dict() saves them; "
            f"got {type(plans).__name__}: load a state_dict a learner saved."
        )
    for key, measured in plans.items():
        for name, n in measured.items():
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(
                    f"state['plans'][{key!r}][{name!r}] is {n!r}; what the planner measured is bytes, a non-negative "
                    f"int: load a state_dict a learner saved, or drop its 'plans' entry (the learner measures again)."
                )
    hint = {"inner_lrs": "the same learn_inner_lr and steps", "model": "the same model", "rule": "the same rule"}
    parts = [("model", model_state), ("inner_lrs", rates)]
    parts += [("rule", rule.state_dict())] if rule is not None else []
    for part, mine in parts:
        same_tensors(f"state[{part!r}]", state[part], mine, hint[part])
