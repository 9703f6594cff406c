"""What a model's structure says about its layers: the output layer (the logits) and the layers
whose output feeds a BatchNorm, from a model, a traced run or a table of layer types.

Both are the study's placement: it left the output layer in full precision and unpruned, and it
pruned the gradients at the inputs of BatchNorm (the convolutions' outputs). :class:`gradstats.Plan`
(``output_layer``, ``prune_at``), :func:`gradstats.recommend` and :func:`gradstats.pruning.allocate`
read them from here.

Example:
    >>> import torch.nn as nn
    >>> net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.LazyLinear(3))
    >>> output_layer(net), batchnorm_inputs(net)
    ('4', ['0'])
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple, Optional

__all__ = ["output_layer", "batchnorm_inputs", "layer_records", "LayerRecord", "MATMUL_TYPES",
           "matmul_types", "register_matmul_type", "matmul_layers", "why_not_matmul", "module_types",
           "log_unplanned"]

_WEIGHT_TYPES = ("Conv1d", "Conv2d", "Conv3d", "Linear")

#: class names of the layers whose output gradient feeds matrix multiplies (the weight gradient
#: ``g^T x`` and the input gradient ``g W``): the layers plans and recommendations select by
#: default. A class counts when its own name or a base class's is here (``LazyLinear``,
#: ``NonDynamicallyQuantizableLinear`` are ``Linear``s). ``Conv1D`` is Hugging Face
#: ``transformers``' linear layer of GPT-2 (recognised by name, transformers is not imported);
#: ``MultiheadAttention``'s output is its ``out_proj``'s, which torch calls functionally (the
#: ``out_proj`` module itself never sees its gradient), so the attention module stands for it.
#: The recurrent layers' output gradient (of the whole output sequence) enters their gates' matrix
#: multiplies after an elementwise product with the gates' derivatives; the gradients inside a
#: stacked ``LSTM`` (between its layers) are not reachable by hooks.
MATMUL_TYPES = ("Linear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d",
                "ConvTranspose3d", "Conv1D", "MultiheadAttention", "LSTM", "GRU", "RNN")
_registered: list[str] = []

#: why modules that own parameters but are not matmul layers are left out of plans (by a part of
#: the class name; the first that matches)
_NOT_MATMUL = (
    (("Embedding",), "an embedding: its output gradient is summed into table rows (an index-add) or "
     "into added parameters, not fed to a matrix multiply"),
    (("Norm",), "a normalisation: its output gradient feeds an elementwise scale"),
)


class LayerRecord(NamedTuple):
    """One layer in model order: its name, its class names (most derived first; ``()`` when
    unknown) and its width (output channels or features; None when unknown)."""

    name: str
    types: tuple[str, ...]
    width: Optional[int]

    def is_a(self, *names: str) -> bool:
        return any(t in names for t in self.types)

    @property
    def linear(self) -> bool:
        return any(t == "Linear" or t.endswith("Linear") for t in self.types)

    @property
    def batchnorm(self) -> bool:
        return any(t.startswith(("BatchNorm", "SyncBatchNorm")) for t in self.types)

    @property
    def matmul(self) -> bool:
        """Whether the layer's output gradient feeds a matrix multiply (:data:`MATMUL_TYPES`, or
        a type registered with :func:`register_matmul_type`)."""
        names = matmul_types()
        return self.linear or any(t in names for t in self.types)


def matmul_types() -> tuple[str, ...]:
    """:data:`MATMUL_TYPES` and the class names added by :func:`register_matmul_type`.

    Example:
        >>> "Conv1D" in matmul_types()
        True
    """
    return MATMUL_TYPES + tuple(_registered)


def register_matmul_type(cls: Any) -> None:
    """Count a module class (or class name) as a matmul layer: plans and recommendations then
    select it by default (a custom fused projection, a quantised linear of another library).
    Subclasses count too when given as a class; a name matches that class name exactly. Plans
    made before registering keep their type list.

    Example:
        >>> import torch
        >>> class MyProj(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__(); self.w = torch.nn.Parameter(torch.ones(2, 2))
        >>> register_matmul_type(MyProj)
        >>> [r.name for r in layer_records({"p": MyProj()}) if r.matmul]
        ['p']
    """
    name = cls.__name__ if isinstance(cls, type) else cls
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_matmul_type takes a module class or a class name, got {cls!r}")
    if name not in MATMUL_TYPES and name not in _registered:
        _registered.append(name)


def matmul_layers(source: Any) -> list[str]:
    """The names of the matmul layers of ``source`` (as :func:`layer_records`), in model order:
    what plans and recommendations select by default (before leaving out the output layer).

    Example:
        >>> matmul_layers({"wte": "Embedding", "attn.c_attn": "Conv1D", "ln": "LayerNorm", "head": "Linear"})
        ['attn.c_attn', 'head']
    """
    return [r.name for r in layer_records(source) if r.matmul]


def log_unplanned(logger: Any, where: str, unplanned: Mapping[str, str]) -> None:
    """One INFO line naming the layers a plan leaves alone (``Plan.unplanned``), grouped by why."""
    if not unplanned:
        return
    groups: dict[str, list[str]] = {}
    for name, why in unplanned.items():
        groups.setdefault(why.split(":")[0], []).append(name)
    shown = "; ".join(f"{why}: {', '.join(names[:6])}{' ...' if len(names) > 6 else ''}"
                      for why, names in groups.items())
    logger.info("%s: %d layer(s) that own parameters are not planned (%s); Plan.explain(model) lists "
                "them with the reasons", where, len(unplanned), shown)


def why_not_matmul(record: LayerRecord) -> str:
    """Why a layer is not selected as a matmul layer, in words (for logs and ``Plan.explain``).

    Example:
        >>> why_not_matmul(LayerRecord("wte", ("Embedding",), 8))[:13]
        'an embedding:'
    """
    for parts, why in _NOT_MATMUL:
        if any(p in t for t in record.types for p in parts):
            return why
    kind = record.types[0] if record.types else "unknown type"
    return (f"not a matmul layer type: {kind} (if its output gradient feeds a matrix multiply, "
            f"gradstats.layers.register_matmul_type({kind}) makes plans select it)")


def _width_of_module(m: Any) -> Optional[int]:
    for attr in ("out_channels", "out_features", "num_features"):
        v = getattr(m, attr, None)
        if isinstance(v, int):
            return v
    return None


def _width_of_shape(shape: Any) -> Optional[int]:
    try:
        return int(list(shape)[1])
    except (TypeError, ValueError, IndexError):
        return None


def _types_of(type_name: Any, bases: Any) -> tuple[str, ...]:
    """A recorded layer's class names: its type and, where the run recorded them, its bases."""
    if not isinstance(type_name, str):
        return ()
    extra = tuple(b for b in bases if isinstance(b, str) and b != type_name) if isinstance(bases, (list, tuple)) else ()
    return (type_name, *extra)


def module_types(module: Any) -> tuple[str, ...]:
    """The class names of ``module`` and its bases, most derived first, without ``Module`` and
    ``object``: what a run records as a layer's ``bases``."""
    return tuple(c.__name__ for c in type(module).__mro__ if c.__name__ not in ("Module", "object"))


def _model_layers(model: Any) -> list[tuple[LayerRecord, Any]]:
    """Every module of ``model`` with its record, in ``named_modules()`` order, wrappers looked through
    (:func:`gradstats.wrappers.named_layers`): the one listing of a model's layers here, which
    :func:`layer_records` and :func:`batchnorm_inputs` read."""
    from gradstats.wrappers import named_layers

    return [(LayerRecord(n, tuple(c.__name__ for c in type(m).__mro__), _width_of_module(m)), m)
            for n, m in named_layers(model)]


def layer_records(source: Any) -> list[LayerRecord]:
    """The layers of ``source`` in model order: a :class:`gradstats.run.Run` (its traced layers,
    in the order they were first called), its ``layer_info()`` DataFrame (columns ``name``,
    ``type``, optionally ``output_shape``), the manifest's list of ``{name, type}`` records, an
    ``nn.Module`` (every module, in ``named_modules()`` order, wrappers looked through), or a
    mapping name -> module, class or class name.

    Example:
        >>> [r.name for r in layer_records({"conv": "Conv2d", "bn": "BatchNorm2d"})]
        ['conv', 'bn']
    """
    import pandas as pd
    import torch.nn as nn

    from gradstats.run import Run

    source = run_if_path(source)
    if isinstance(source, Run):
        source = source.layer_info()
    if isinstance(source, nn.Module):
        return [rec for rec, _ in _model_layers(source)]
    if isinstance(source, pd.DataFrame):
        if len(source) == 0:
            return []
        if not {"name", "type"} <= set(source.columns):
            raise ValueError("a layer table needs the columns 'name' and 'type' (Run.layer_info()); "
                             f"got {list(source.columns)}")
        shapes = source["output_shape"] if "output_shape" in source.columns else [None] * len(source)
        bases = source["bases"] if "bases" in source.columns else [None] * len(source)
        return [LayerRecord(str(n), _types_of(t, b), _width_of_shape(s))
                for n, t, s, b in zip(source["name"], source["type"], shapes, bases)]
    if isinstance(source, Mapping):
        out = []
        for n, t in source.items():
            if isinstance(t, nn.Module):
                out.append(LayerRecord(str(n), tuple(c.__name__ for c in type(t).__mro__), _width_of_module(t)))
            elif isinstance(t, type):
                out.append(LayerRecord(str(n), tuple(c.__name__ for c in t.__mro__), None))
            elif isinstance(t, str):
                out.append(LayerRecord(str(n), (t,), None))
            elif t is None:        # type unknown
                out.append(LayerRecord(str(n), (), None))
            else:
                raise ValueError(f"a mapping of layers must map names to modules, classes or class "
                                 f"names; {n!r} maps to a {type(t).__name__}")
        return out
    if isinstance(source, Iterable) and not isinstance(source, (str, bytes)):
        out = []
        for rec in source:
            if not (isinstance(rec, Mapping) and "name" in rec):
                raise ValueError("a list of layers must hold {name, type} records (the run manifest's "
                                 f"'layers'); got {rec!r}")
            out.append(LayerRecord(str(rec["name"]), _types_of(rec.get("type"), rec.get("bases")),
                                   _width_of_shape(rec.get("output_shape"))))
        return out
    raise ValueError("the layers of a model come from a Run (or the path of its directory), its layer_info() "
                     "table, the manifest's layer records, an nn.Module or a mapping name -> module/class/class "
                     f"name; got {_what(source)}")


def run_if_path(target: Any) -> Any:
    """The run at ``target`` where it is the path of a run's directory (it holds ``manifest.json``),
    as every stage that reads a run takes it; else ``target`` itself.

    Example:
        >>> from gradstats.zoo.data import data_dir
        >>> type(run_if_path(data_dir() / "sample-run")).__name__, run_if_path(["fc1"])
        ('Run', ['fc1'])
    """
    if isinstance(target, (str, os.PathLike)) and os.path.isfile(os.path.join(os.fspath(target), "manifest.json")):
        from gradstats.run import open_run

        return open_run(target)
    return target


def _what(target: Any) -> str:
    if isinstance(target, (str, os.PathLike)):
        return f"{os.fspath(target)!r}, which holds no run"
    return type(target).__name__


def output_layer(source: Any) -> str | None:
    """The layer whose output reaches the loss (the logits): the last layer, in model order,
    whose type is ``Linear``; ``None`` when there is none.

    The study leaves this layer unpruned and unquantised, and pruning the logits gradient is
    what costs accuracy (a CNN on Fashion-MNIST lost 0.8 points at 85%). ``source``: as
    :func:`layer_records`. A type given by name counts as linear when it is ``Linear`` or ends
    in ``Linear`` (``LazyLinear``, ``NonDynamicallyQuantizableLinear``, ``ColumnParallelLinear``).
    Models whose logits come from something else (an embedding matrix used functionally, a
    custom module) must name their output layer.

    Example:
        >>> import torch.nn as nn
        >>> output_layer(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)))
        '2'
        >>> output_layer({"conv1": "Conv2d", "fc1": "Linear", "fc2": "Linear", "bn": "BatchNorm1d"})
        'fc2'
        >>> output_layer({"conv1": "Conv2d"}) is None
        True
    """
    last = None
    for r in layer_records(source):
        if r.linear:
            last = r.name
    return last


def batchnorm_inputs(source: Any, *inputs: Any, **kwargs: Any) -> list[str]:
    """The convolution and linear layers whose output is the input of a BatchNorm: the study's
    pruning placement, and the layers whose exact weight gradient is orthogonal to their weights
    channel by channel (:func:`gradstats.fpanalysis.weight_gradient_alignment`).

    With example ``inputs`` (an ``nn.Module`` only) one forward pass without gradients finds them
    exactly (each BatchNorm's input matched with the layer that produced it). Without, from the
    structure: a convolution or linear layer followed in model order (``named_modules()``, or a
    run's call order) by a BatchNorm of the same width (where widths are known): the pattern of
    ``conv, bn`` modules that standard models follow. ``source``: as :func:`layer_records`.

    Example:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
        >>> batchnorm_inputs(net), batchnorm_inputs(net, torch.randn(3, 4))
        (['0'], ['0'])
    """
    import torch.nn as nn

    if inputs or kwargs:
        if not isinstance(source, nn.Module):
            raise ValueError(f"batchnorm_inputs with example inputs needs a torch.nn.Module, got "
                             f"{type(source).__name__}")
        return _traced_batchnorm_inputs(source, *inputs, **kwargs)
    if isinstance(source, (int, float)) or source is None:
        raise ValueError(f"batchnorm_inputs needs a torch.nn.Module, a Run or a layer table, got "
                         f"{type(source).__name__}")
    if isinstance(source, nn.Module):           # leaves only: containers do not sit between
        recs = [r for r, m in _model_layers(source) if not any(True for _ in m.children())]
    else:
        recs = [r for r in layer_records(source) if r.types]
    out = []
    for a, b in zip(recs, recs[1:]):
        if a.is_a(*_WEIGHT_TYPES) or a.linear:
            if b.batchnorm and (a.width is None or b.width is None or a.width == b.width):
                out.append(a.name)
    return out


def _traced_batchnorm_inputs(model: Any, *inputs: Any, **kwargs: Any) -> list[str]:
    import torch
    import torch.nn as nn

    bn = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
    layers = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)
    produced: dict[int, str] = {}
    found: list[str] = []
    handles = []

    def after(name: str):
        def hook(m: nn.Module, i: Any, out: Any) -> None:
            if isinstance(out, torch.Tensor):
                produced[id(out)] = name
        return hook

    def before(m: nn.Module, i: Any) -> None:
        if i and isinstance(i[0], torch.Tensor) and id(i[0]) in produced:
            name = produced[id(i[0])]
            if name not in found:
                found.append(name)

    listed = [(rec.name, m) for rec, m in _model_layers(model)]
    for name, m in listed:
        if isinstance(m, layers):
            handles.append(m.register_forward_hook(after(name)))
        elif isinstance(m, bn):
            handles.append(m.register_forward_pre_hook(before))
    try:
        with torch.no_grad():
            model(*inputs, **kwargs)
    finally:
        for h in handles:
            h.remove()
    order = [n for n, _ in listed]
    return sorted(found, key=order.index)


def module_candidates(target: Any) -> list[tuple[str, tuple[str, ...] | None]]:
    """``(name, class names or None)`` of every candidate module of ``target``, in order
    (:func:`gradstats.layers.layer_records`; a run also by the path of its directory, as every stage
    that reads a run takes it; or a plain list of names)."""
    import torch.nn as nn

    from gradstats.run import Run

    target = run_if_path(target)
    if isinstance(target, (nn.Module, Run, Mapping)):
        return [(r.name, r.types or None) for r in layer_records(target)]
    if isinstance(target, (str, bytes, os.PathLike)) or not isinstance(target, Iterable):
        raise ValueError("resolve a plan against an nn.Module, a gradstats Run (or the path of its directory), a "
                         f"mapping name -> module/class/class name, or a list of module names; got {_what(target)}")
    names = list(target)
    if not all(isinstance(n, str) for n in names):
        raise ValueError("a list of module names must hold strings only")
    return [(n, None) for n in names]
