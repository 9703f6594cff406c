"""The :class:`Plan`: entries, defaults, provenance; resolution, JSON, views. See :mod:`gradstats.plan`."""
from __future__ import annotations

import dataclasses
import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from gradstats.formats import FPFormat
from gradstats.layers import module_candidates
from gradstats.plan import _views
from gradstats.plan._rules import RULE_FIELDS, PlanEntry, Rule, _fields_to_json
from gradstats.plan._values import Provenance, _check_keys, _err
from gradstats.scheme import Scheme

if TYPE_CHECKING:
    import pandas as pd


#: value of the ``"schema"`` key of a plan file
SCHEMA = "gradstats.plan"
#: version of the plan file format written by this module
SCHEMA_VERSION = 1
#: the convolution and linear classes (the study's layers); ``Plan.uniform(layers=None)`` selects
#: every matmul layer (:data:`gradstats.layers.MATMUL_TYPES`: these, ``transformers``' ``Conv1D``,
#: ``nn.MultiheadAttention`` and registered types)
CONV_LINEAR_TYPES = ("Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d",
                     "ConvTranspose3d", "Linear")


# --------------------------------------------------------------------------- targets
# --------------------------------------------------------------------------- the plan
#: the values of :attr:`Plan.prune_at`
PRUNE_AT = (None, "auto", "batchnorm_inputs")


def pruned_layers(prune_at: str | None, target: Any) -> list[str] | None:
    """The layers of ``target`` where ``prune_at`` (:attr:`Plan.prune_at`) lets rules prune, or
    None where it restricts nothing."""
    if prune_at is None or isinstance(target, (list, tuple)):
        return None
    from gradstats.layers import batchnorm_inputs

    found = batchnorm_inputs(target)
    return None if (not found and prune_at == "auto") else found


def default_prune_at(prune_at: str | bool | None, default_selection: bool) -> str | None:
    """``prune_at`` as given to ``Plan.uniform`` or ``recommend``: None is ``"auto"`` with the
    default layer selection and no restriction with layers named; True is ``"auto"``; False is
    no restriction."""
    if prune_at is None:
        return "auto" if default_selection else None
    if prune_at is True:
        return "auto"
    if prune_at is False:
        return None
    return prune_at
@dataclass(frozen=True)
class Plan:
    """A per-layer plan for the neural gradients of a model (see the module doc for precedence).

    Args:
        entries: :class:`PlanEntry` objects (or dicts with their fields), in order.
        defaults: the :class:`Rule` every planned module starts from (or a dict of its fields).
        provenance: where the plan came from; default: this version, now, no source.
        output_layer: a layer the plan leaves untouched whatever its entries say: a module name,
            ``"auto"`` (the model's output layer, the one whose output reaches the loss: the last
            ``Linear`` in model order, :func:`gradstats.pruning.allocation.output_layer`), or None
            (no exception; the default of a plan built from entries). ``Plan.uniform`` and
            ``recommend`` use ``"auto"``: the study kept the classifier in full precision and
            unpruned, and pruning the logits' gradient is what cost accuracy on our CNN. Pattern
            entries skip it; an entry naming it exactly still plans it.
        prune_at: where the rules' pruning applies: None (wherever they say; the default of a
            plan built from entries), ``"auto"`` (the layers whose output feeds a BatchNorm, the
            study's placement, when the model has any such layer; otherwise everywhere) or
            ``"batchnorm_inputs"`` (only those). On the other layers a ``sparsity`` that comes
            from the defaults or a pattern entry is dropped (their format stays); an entry naming
            a layer exactly and setting ``sparsity`` still prunes it. The layers are found from
            the structure (:func:`gradstats.layers.batchnorm_inputs`); against a plain list of
            names nothing is known and nothing is dropped. ``Plan.uniform`` and ``recommend`` use
            ``"auto"``: pruning a linear layer's gradient costs more (its weight gradient sums
            over the batch alone, a convolution's over every position too).

    Example:
        >>> import tempfile, os
        >>> plan = Plan([PlanEntry("fc1", format="e4m3fn"), {"layer": "fc2", "sparsity": 0.5}],
        ...             defaults={"rounding": "stochastic"})
        >>> path = os.path.join(tempfile.mkdtemp(), "plan.json")
        >>> plan.save(path)
        >>> Plan.load(path) == plan
        True
        >>> plan.resolve(["fc1", "fc2", "fc3"])["fc2"].rounding
        'stochastic'
    """

    entries: tuple[PlanEntry, ...] = ()
    defaults: Rule = field(default_factory=Rule)
    provenance: Provenance | None = field(default_factory=Provenance.now)
    output_layer: str | None = None
    prune_at: str | None = None
    #: per planned layer, what its rule was predicted to do and did when replayed on the run's
    #: samples (:meth:`verify`'s per-layer rows, JSON-ready; ``recommend`` fills it), with ``note``:
    #: why the layer's first choice was replaced, if it was
    checks: tuple = ()
    #: the largest noise ratio per layer ``recommend`` kept the plan within (None: not bounded),
    #: and per planned layer its requested and granted sparsity, why, the format's storage and why
    #: it was chosen, and the predicted noise ratio (:mod:`gradstats.plan.noise_budget`; JSON-ready
    #: dicts with ``layer``, ``requested_sparsity``, ``sparsity``, ``sparsity_reason``,
    #: ``format_reason``, ``bits``, ``numel``, ``predicted_noise``, ``pruning_noise``)
    noise_bound: float | None = None
    noise: tuple = ()

    def __post_init__(self) -> None:
        if self.output_layer is not None and (not isinstance(self.output_layer, str) or not self.output_layer):
            raise ValueError(f"output_layer must be a layer name, 'auto' or None, got {self.output_layer!r}")
        if self.prune_at not in PRUNE_AT:
            raise ValueError(f"prune_at must be one of {list(PRUNE_AT)} (None: wherever the rules say), got "
                             f"{self.prune_at!r}")
        if isinstance(self.entries, (str, bytes, Mapping, PlanEntry)) or not isinstance(self.entries, Iterable):
            raise ValueError(f"entries must be a list of PlanEntry (or dicts), got {type(self.entries).__name__}")
        entries = []
        for i, e in enumerate(self.entries):
            if isinstance(e, Mapping):
                e = PlanEntry.from_dict(e, f"layers[{i}]")
            elif not isinstance(e, PlanEntry):
                raise ValueError(f"layers[{i}]: expected a PlanEntry or a dict, got {type(e).__name__}")
            entries.append(e)
        object.__setattr__(self, "entries", tuple(entries))
        if isinstance(self.defaults, Mapping):
            object.__setattr__(self, "defaults", _defaults_from_dict(self.defaults))
        elif not isinstance(self.defaults, Rule):
            raise ValueError(f"defaults must be a Rule or a dict of rule fields, got {type(self.defaults).__name__}")
        if isinstance(self.provenance, Mapping):
            object.__setattr__(self, "provenance", Provenance.from_dict(self.provenance))
        elif self.provenance is not None and not isinstance(self.provenance, Provenance):
            raise ValueError(f"provenance must be a Provenance, a dict or None, got {type(self.provenance).__name__}")
        if not isinstance(self.checks, (list, tuple)) or not all(isinstance(c, Mapping) for c in self.checks):
            raise ValueError(f"checks must be a list of per-layer check records (dicts), got {self.checks!r}")
        object.__setattr__(self, "checks", tuple(dict(c) for c in self.checks))
        if self.noise_bound is not None and (isinstance(self.noise_bound, bool) or
                                             not isinstance(self.noise_bound, (int, float)) or not self.noise_bound > 0):
            raise ValueError(f"noise_bound must be None or a positive noise ratio, got {self.noise_bound!r}")
        if not isinstance(self.noise, (list, tuple)) or not all(isinstance(c, Mapping) and "layer" in c
                                                                for c in self.noise):
            raise ValueError(f"noise must be a list of per-layer records (dicts with a 'layer'), got {self.noise!r}")
        object.__setattr__(self, "noise", tuple(dict(c) for c in self.noise))
        # each entry completed by the defaults alone must be a valid rule
        for i, e in enumerate(entries):
            self.rule_of([e], f"layers[{i}] ({e.layer!r}) with the defaults")

    # -- construction
    @classmethod
    def uniform(cls, *, format: FPFormat | Scheme | str | None = None, sparsity: float | None = None,
                rounding: str | None = None, scale: str | None = None,
                layers: Sequence[str] | str | None = None, scale_value: float | None = None,
                threshold_rule: str | None = None,
                source: str | os.PathLike[str] | None = None,
                output_layer: str | bool | None = None, prune_at: str | bool | None = None,
                scale_shift: int = 0) -> "Plan":
        """The same rule on every selected layer.

        ``format``: a format, or a block-scaled scheme (:class:`~gradstats.scheme.Scheme`, ``"nvfp4"``,
        ``"e4m3fn:block=32:scale_rounding=rceil"``), which sets the rule's block fields.
        ``layers``: names or globs (``"re:..."`` for a regex); ``None`` selects every matmul layer
        (:func:`gradstats.layers.matmul_types`: convolutions, linear layers and their subclasses,
        ``transformers``' ``Conv1D``, ``nn.MultiheadAttention``, registered types) but the model's
        output layer; :meth:`explain` lists what is left out and why.
        ``output_layer``: ``"auto"`` leaves the model's output layer (the logits: the last
        ``Linear``) in full precision and unpruned, as the study did; a name leaves that layer;
        ``False`` plans it like the others; None (default): ``"auto"`` with the default selection,
        ``False`` when ``layers`` names the layers. ``prune_at`` (see :class:`Plan`): None (default)
        is ``"auto"`` with the default selection (prune where the gradient enters a BatchNorm, if
        the model has such layers), no restriction when ``layers`` names the layers; ``False``: no
        restriction. The defaults follow what trains: ``rounding`` stochastic for formats of
        6 bits or fewer (round-to-nearest flushes most small values of a wide layer to zero, a
        bias SGD does not average away; ``docs/fpanalysis.md``), nearest otherwise; ``scale``
        ``"amax"`` with stochastic rounding (unbiased to the smallest value; the tensor's maximum
        lands in the top binade), ``"lognormal"`` with nearest; ``threshold_rule`` the
        :class:`Rule` default (``"histogram"``); ``scale_shift`` (binades above the amax scale, with
        ``scale="amax"``) 0. The rule goes into the plan's ``defaults``; each entry names layers only.
        :meth:`verify` checks what the plan does on a traced run.

        Example:
            >>> import torch
            >>> m = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.ReLU(), torch.nn.Flatten(),
            ...                         torch.nn.LazyLinear(3))
            >>> plan = Plan.uniform(format="float6_e3m2fn", sparsity=0.85)
            >>> sorted(plan.resolve(m)), str(plan.defaults.format), plan.defaults.rounding
            (['0'], 'e3m2fn', 'stochastic')
            >>> sorted(Plan.uniform(sparsity=0.85, output_layer=False).resolve(m))
            ['0', '3']
            >>> list(Plan.uniform(layers=["0"]).resolve(m))
            ['0']
            >>> Plan.uniform(format="mxfp8_e4m3").defaults.scheme   # a scheme sets the block fields
            Scheme('mxfp8_e4m3')
        """
        fmt = None if format is None else Scheme.parse(format)
        if rounding is None and fmt is not None and fmt.rounding != "nearest":
            rounding = fmt.rounding
        if rounding is None:
            rounding = "stochastic" if fmt is not None and fmt.element.bits <= 6 else "nearest"
        blocks = fmt is not None and fmt.block_size is not None
        if scale is None:
            scale = "amax" if (rounding == "stochastic" or blocks) else "lognormal"
        kw = {} if threshold_rule is None else {"threshold_rule": threshold_rule}
        defaults = Rule(format=format, sparsity=sparsity, rounding=rounding, scale=scale,
                        scale_value=scale_value, scale_shift=scale_shift, **kw)
        if layers is None:
            from gradstats.layers import matmul_types

            entries = [PlanEntry("*", types=matmul_types())]
        else:
            if isinstance(layers, str):
                layers = [layers]
            entries = [PlanEntry(p) for p in layers]
            if not entries:
                raise ValueError("layers is empty: pass names or globs, or None for every conv and linear layer")
        if output_layer is None:
            output_layer = "auto" if layers is None else False
        if output_layer is False:
            output_layer = None
        elif output_layer is True:
            output_layer = "auto"
        prune_at = default_prune_at(prune_at, layers is None)
        gen = (f"Plan.uniform(format={None if format is None else str(defaults.scheme)!r}, "
               f"sparsity={sparsity!r}, rounding={rounding!r}, scale={scale!r})")
        prov = Provenance.now(source=None if source is None else os.fspath(source), generator=gen)
        return cls(entries, defaults, prov, output_layer=output_layer,
                   prune_at=prune_at if defaults.prunes else None)

    def with_entries(self, *entries: PlanEntry | Mapping[str, Any]) -> "Plan":
        """A copy with ``entries`` appended (they take precedence over earlier ones of their kind)."""
        return dataclasses.replace(self, entries=(*self.entries, *entries))

    def with_allocation(self, allocation: Any) -> "Plan":
        """A copy with the per-layer sparsity targets of a :class:`gradstats.pruning.Allocation`
        appended (``PlanEntry(layer, sparsity=target)``; ``sparsity=None``, not pruned, for the layers
        it excludes).

        Example:
            >>> from gradstats.pruning import allocate
            >>> a = allocate({"fc1": {"mu": -9.0, "sigma": 2.0, "n": 1000},
            ...               "fc2": {"mu": -12.0, "sigma": 1.0, "n": 30}}, 0.8,
            ...              layer_info={"fc1": "Linear", "fc2": "Linear"})
            >>> plan = Plan.uniform(layers=["fc1", "fc2"]).with_allocation(a)
            >>> plan.resolve(["fc1", "fc2"])["fc2"].sparsity is None
            True
        """
        try:
            targets = allocation.layer_targets()
        except AttributeError:
            raise ValueError(f"with_allocation takes a gradstats.pruning.Allocation (from allocate()), got "
                             f"{type(allocation).__name__}") from None
        return self.with_entries(*(PlanEntry(name, sparsity=t) for name, t in targets.items()))

    # -- resolution
    def rule_of(self, matched: Sequence[PlanEntry], where: str = "") -> Rule:
        """The complete :class:`Rule` of a layer that ``matched`` entries select: the defaults,
        then the patterns' overrides, then the exact entries' (``where`` names the layer in an error).

        Example:
            >>> e = [PlanEntry("*", sparsity=0.5), PlanEntry("fc", format="e5m2")]
            >>> Plan(e).rule_of(e).describe()[:4]
            'e5m2'
        """
        fields = {k: getattr(self.defaults, k) for k in RULE_FIELDS}
        for e in sorted(matched, key=lambda e: not e.is_pattern):  # stable: patterns, then exact
            fields.update(e.overrides)
        try:
            return Rule(**fields)
        except ValueError as exc:
            raise _err(where, str(exc)) from None

    def resolve(self, target: Any, *, strict: bool = True) -> dict[str, Rule]:
        """The complete :class:`Rule` of every planned module of ``target``, in module order.

        ``target``: an ``nn.Module`` (inside a DDP wrapper too), a :class:`gradstats.run.Run`
        (its traced layers), a mapping ``name -> module, class or class name``, or a list of
        names (then no entry may select ``types``). Modules no entry matches are absent. With
        ``strict`` an entry that matches no module is a ``ValueError``; otherwise a warning.

        Example:
            >>> plan = Plan([PlanEntry("*", sparsity=0.5), PlanEntry("b", sparsity=0.9),
            ...              PlanEntry("b*", sparsity=0.7)])
            >>> {n: r.sparsity for n, r in plan.resolve(["a", "b", "bb"]).items()}
            {'a': 0.5, 'b': 0.9, 'bb': 0.7}
        """
        return {name: rule for name, rule, _ in self.resolve_entries(target, strict=strict)}

    def output_layer_of(self, target: Any) -> str | None:
        """The layer of ``target`` this plan leaves untouched (see ``output_layer``), or None.

        Example:
            >>> Plan.uniform(sparsity=0.5).output_layer_of({"conv": "Conv2d", "fc": "Linear"})
            'fc'
        """
        if self.output_layer is None:
            return None
        if self.output_layer != "auto":
            return self.output_layer
        from gradstats.layers import output_layer

        return output_layer(target) if not isinstance(target, (list, tuple)) else None

    def pruned_layers_of(self, target: Any) -> list[str] | None:
        """The layers of ``target`` where ``prune_at`` lets the rules prune, or None where it
        restricts nothing (``prune_at=None``, ``"auto"`` on a model without BatchNorm inputs, a
        plain list of names).

        Example:
            >>> import torch.nn as nn
            >>> net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(8),
            ...                     nn.ReLU(), nn.Linear(8, 2))
            >>> Plan.uniform(sparsity=0.85).pruned_layers_of(net)
            ['0']
        """
        return pruned_layers(self.prune_at, target)

    def explain(self, target: Any) -> "pd.DataFrame":
        """Per layer of ``target`` (an ``nn.Module``, a run, a mapping name -> type): what the plan
        does there and why, as a DataFrame with columns ``layer``, ``type``, ``planned``, ``rule``
        (the resolved rule in words) and ``why``. Lists every planned layer and every layer that
        owns parameters (for a model; every recorded layer for a run) but is left out: the output
        layer, types that are not matmul layers (embeddings, normalisations, recurrent layers),
        layers no entry matches, and where ``prune_at`` dropped a layer's sparsity.

        Example:
            >>> import torch.nn as nn
            >>> net = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 10))
            >>> Plan.uniform(format="e4m3fn").explain(net)[["layer", "type", "planned"]]
              layer       type  planned
            0     0  Embedding    False
            1     1     Linear     True
            2     2  LayerNorm    False
            3     3     Linear    False
        """
        return _views.explain(self, target)

    def unplanned(self, target: Any) -> dict[str, str]:
        """The layers of ``target`` that own parameters but this plan leaves alone, with why
        (the rows of :meth:`explain` that are not planned).

        Example:
            >>> import torch.nn as nn
            >>> why = Plan.uniform(format="e4m3fn").unplanned(nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 2)))
            >>> {name: text[:16] for name, text in why.items()}
            {'0': 'an embedding: it', '1': 'the output layer'}
        """
        df = self.explain(target)
        return dict(zip(df["layer"][~df["planned"]], df["why"][~df["planned"]]))

    def resolve_entries(self, target: Any, *, strict: bool = True) -> list[tuple[str, Rule, list[int]]]:
        """:meth:`resolve` with the entries behind each rule: ``[(module, rule, entry indices)]``.

        Example:
            >>> Plan([PlanEntry("*", sparsity=0.5), PlanEntry("b", sparsity=0.9)]).resolve_entries(["a", "b"])[1][2]
            [0, 1]
        """
        modules = module_candidates(target)
        skip = self.output_layer_of(target)
        pruned = self.pruned_layers_of(target)
        pruned = None if pruned is None else set(pruned)
        hits = [0] * len(self.entries)
        exact: dict[str, list[int]] = {}
        patterns: list[int] = []
        for i, e in enumerate(self.entries):
            (patterns.append(i) if e.is_pattern else exact.setdefault(e.layer, []).append(i))
        out = []
        for name, types in modules:
            idx = [i for i in patterns if self.entries[i].matches(name, types)]
            idx += [i for i in exact.get(name, ()) if self.entries[i].matches(name, types)]
            if not idx:
                continue
            for i in idx:
                hits[i] += 1
            if name == skip and all(self.entries[i].is_pattern for i in idx):
                continue            # the output layer: only an entry naming it exactly plans it
            rule = self.rule_of([self.entries[i] for i in idx],
                                  f"module {name!r} (entries {[self.entries[i].layer for i in idx]})")
            if (pruned is not None and name not in pruned and rule.prunes and not any(
                    not self.entries[i].is_pattern and "sparsity" in self.entries[i].overrides for i in idx)):
                rule = dataclasses.replace(rule, sparsity=None)     # prune_at: not where it prunes
                if rule.is_identity:
                    continue
            out.append((name, rule, idx))
        missing = [self.entries[i] for i, h in enumerate(hits) if h == 0]
        if missing:
            names = [n for n, _ in modules]
            if len(self.entries) > 1 and 2 * len(missing) > len(self.entries):   # most entries: say so plainly
                pats = ", ".join(repr(e.layer) for e in missing[:4]) + (" ..." if len(missing) > 4 else "")
                from gradstats.layers import matmul_types

                mm = set(matmul_types())        # the model's layers a plan would name, when it has them
                own = [n for n, t in modules if t and mm.intersection(t)] or names
                mine = ", ".join(repr(n) for n in own[:6]) + (" ..." if len(own) > 6 else "")
                msg = (f"the plan seems made for another model: {len(missing)} of its {len(self.entries)} "
                       f"entries match no module of this one (the plan's {pats}; the model's {mine or 'none'}); "
                       "load the plan recommended for this model, or recommend one from a run of it")
            else:
                shown = ", ".join(repr(n) for n in names[:15]) + (" ..." if len(names) > 15 else "")
                msg = "; ".join(
                    f"layer pattern {e.layer!r}" + (f" with types {list(e.types)}" if e.types else "")
                    + " matches no module" for e in missing) + f" (modules: {shown or 'none'})"
            if strict:
                raise ValueError(msg)
            warnings.warn(msg, stacklevel=3)      # once: the user's plan needs a look
        return out

    # -- views
    def storage(self) -> dict[str, float] | None:
        """What the plan stores per gradient value, over the layers ``recommend`` planned (its
        ``noise`` records; None without them): ``mean_bits`` (element-weighted; a layer left alone
        counts 16 bits), ``bytes`` and ``bytes_16bit`` (per call of every planned layer) and
        ``saved_fraction`` (of the 16-bit bytes). Pruning is not counted: a sparse gradient is
        stored dense.

        Example:
            >>> p = Plan([], noise=[{"layer": "a", "bits": 4.5, "numel": 300}, {"layer": "b", "bits": 16.0, "numel": 100}])
            >>> p.storage()["mean_bits"], p.storage()["saved_fraction"]
            (7.375, 0.5390625)
        """
        recs = [c for c in self.noise if c.get("bits") is not None and c.get("numel")]
        if not recs:
            return None
        n = float(sum(c["numel"] for c in recs))
        bits = float(sum(c["numel"] * c["bits"] for c in recs))
        return {"mean_bits": bits / n, "bytes": bits / 8.0, "bytes_16bit": 2.0 * n, "saved_fraction": 1.0 - bits / (16.0 * n)}

    def to_dataframe(self, target: Any = None) -> "pd.DataFrame":
        """A pandas view: one row per entry (completed by the defaults), or with ``target`` one
        row per resolved module (with the indices of the ``entries`` that matched it).

        ``sparsity`` is the sparsity the plan applies: None where ``prune_at`` leaves the layer
        unpruned (with ``target``; without it, on the entries ``recommend`` predicted no sparsity
        for), and ``sparsity_note`` says why (``""`` where the rule's sparsity applies as it is).

        Example:
            >>> Plan.uniform(format="e5m2").to_dataframe()[["layer", "format", "scale"]]
              layer format      scale
            0     *   e5m2  lognormal
            >>> import torch.nn as nn
            >>> net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(8),
            ...                     nn.ReLU(), nn.Linear(8, 2))
            >>> Plan.uniform(format="e4m3fn", sparsity=0.85).to_dataframe(net)[["layer", "sparsity"]]
              layer  sparsity
            0     0      0.85
            1     3       NaN
        """
        return _views.to_dataframe(self, target)

    def to_dict(self) -> dict[str, Any]:
        """The JSON document of the plan (see ``docs/plan-format.md``)."""
        return {"schema": SCHEMA, "version": SCHEMA_VERSION,
                "provenance": None if self.provenance is None else self.provenance.to_dict(),
                "defaults": _fields_to_json({k: getattr(self.defaults, k) for k in RULE_FIELDS
                                             if k != "predicted"}),
                "layers": [e.to_dict() for e in self.entries],
                **({"output_layer": self.output_layer} if self.output_layer is not None else {}),
                **({"prune_at": self.prune_at} if self.prune_at is not None else {}),
                **({"checks": [dict(c) for c in self.checks]} if self.checks else {}),
                **({"noise_bound": self.noise_bound} if self.noise_bound is not None else {}),
                **({"noise": [dict(c) for c in self.noise]} if self.noise else {})}

    @classmethod
    def from_dict(cls, d: Any) -> "Plan":
        """Read and validate a plan document (as :meth:`to_dict` gives)."""
        if not isinstance(d, Mapping):
            raise ValueError(f"a plan must be a JSON object, got {type(d).__name__}")
        if d.get("schema") != SCHEMA:
            raise ValueError(f"not a gradstats plan: expected \"schema\": \"{SCHEMA}\", got "
                             f"{d.get('schema')!r}")
        v = d.get("version")
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"bad plan schema version {v!r}: expected a positive integer ({SCHEMA_VERSION})")
        if v > SCHEMA_VERSION:
            raise ValueError(f"plan schema version {v} is newer than this gradstats reads "
                             f"(version {SCHEMA_VERSION}); upgrade gradstats")
        _check_keys(d, ("schema", "version", "provenance", "defaults", "layers", "output_layer", "prune_at",
                        "checks", "noise_bound", "noise"), "plan")
        layers = d.get("layers", [])
        if not isinstance(layers, list):
            raise ValueError(f"plan: 'layers' must be a list of entries, got {type(layers).__name__}")
        prov = d.get("provenance")
        return cls(entries=[PlanEntry.from_dict(e, f"layers[{i}]") for i, e in enumerate(layers)],
                   defaults=_defaults_from_dict(d.get("defaults", {})),
                   provenance=None if prov is None else Provenance.from_dict(prov),
                   output_layer=d.get("output_layer"), prune_at=d.get("prune_at"), checks=d.get("checks", ()),
                   noise_bound=d.get("noise_bound"), noise=d.get("noise", ()))

    def to_json(self) -> str:
        """The plan document as indented JSON text."""
        return json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n"

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan as JSON (atomically)."""
        from gradstats.run import atomic_write_bytes

        atomic_write_bytes(Path(path), self.to_json().encode())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "Plan":
        """Read a plan file written by :meth:`save` or by hand; errors name the file and the problem."""
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"no plan file at {p}")
        try:
            d = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{p}: not valid JSON ({exc})") from None
        try:
            return cls.from_dict(d)
        except ValueError as exc:
            raise ValueError(f"{p}: {exc}") from None

    def export(self, target: str = "json", model: Any = None, *, path: str | os.PathLike[str] | None = None,
               strict: bool = False) -> dict[str, Any]:
        """The plan resolved per layer in another stack's terms (a JSON-ready dict).

        ``target``: ``"json"`` (per layer: format name and fields, scale rule and value,
        rounding, blocks, pruning), ``"torchao"`` (``torchao.float8`` ``Float8LinearConfig``
        fields per linear layer: the ``grad_output`` casts) or ``"te"`` (a Transformer Engine
        debug config for nvdlfw-inspect under ``"config"``, written as YAML with ``path``); see
        ``docs/plan-format.md``.
        ``model``: anything :meth:`resolve` takes; ``None`` uses the plan's exact layer names
        (no patterns allowed). What the target cannot express is listed under ``"dropped"``
        (per layer) and ``"skipped"`` (layers left out), with a warning; ``strict`` raises instead.
        ``path``: also write the result there (JSON; YAML for ``"te"``).

        Example:
            >>> plan = Plan([PlanEntry("fc", format="e5m2", scale="amax")])
            >>> plan.export("json")["layers"]["fc"]["format"]
            'e5m2'
            >>> plan.export("torchao", {"fc": "Linear"})["configs"]["fc"]["cast_config_grad_output"]
            {'scaling_type': 'dynamic', 'scaling_granularity': 'tensorwise', 'target_dtype': 'float8_e5m2'}
            >>> import warnings
            >>> with warnings.catch_warnings():
            ...     warnings.simplefilter("ignore")    # the note: TE's amax scale is not a power of two
            ...     te = plan.export("te", {"fc": "Linear"})["config"]["gradstats_0_fc"]["transformer_engine"]
            >>> te["FakeQuant"]["quant_format"], te["FakeQuant"]["gemms"]
            ('FP8E5M2', ['dgrad', 'wgrad'])
        """
        from gradstats.plan.export import export

        return export(self, target, model, path=path, strict=strict)

    def verify(self, run: Any, *, steps: Any = "auto", seed: int = 0, bias_bound: float | None = None,
               flush_bound: float | None = None, overflow_bound: float | None = None) -> Any:
        """Check the plan against a traced run: per planned layer and calibration step, what its
        operator (pruning, then rounding) is predicted to do and what it does when replayed on the
        run's stored samples, against the bounds on clipping, magnitude gain and bias, and flushing
        (:func:`gradstats.plan.checks.verify`; a :class:`~gradstats.plan.checks.Verification`, whose
        ``table()`` prints it), with each layer's predicted noise ratio (``noise``, the
        ``predicted_noise`` column; :func:`gradstats.predicted_noise`).

        Example:
            >>> import tempfile, torch, gradstats
            >>> m = torch.nn.Sequential(torch.nn.Linear(16, 64))
            >>> with gradstats.trace(m, tempfile.mkdtemp(), sample_every=1) as t:
            ...     m(torch.randn(32, 16)).exp().sum().backward(); t.step()
            >>> Plan.uniform(format="e5m2", rounding="stochastic", output_layer=False).verify(t.path).ok
            True
        """
        from gradstats.plan.checks import OVERFLOW_BOUND, verify
        from gradstats.plan.noise_prediction import predicted_noise

        v = verify(self, run, steps=steps, seed=seed, bias_bound=bias_bound, flush_bound=flush_bound,
                   overflow_bound=OVERFLOW_BOUND if overflow_bound is None else overflow_bound)
        if not v.rows:
            return v
        noise = predicted_noise(run, self, steps=v.steps).records
        return dataclasses.replace(v, noise={rec["layer"]: rec["noise"] for rec in noise})

    def to_torchao(self, model: Any, *, emulate: bool = False, strict: bool = False) -> list:
        """The plan as real ``torchao.float8`` objects: ``[(Float8LinearConfig, module_filter_fn)]``,
        one pair per config (applied by :func:`gradstats.integrations.torchao.convert`). Needs torchao.

        Example:
            >>> import torch
            >>> m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
            >>> [(str(c.cast_config_grad_output.target_dtype), keep(m[0], "0"), keep(m[2], "2"))
            ...  for c, keep in Plan.uniform(format="e4m3fn", scale="amax").to_torchao(m)]
            [('torch.float8_e4m3fn', True, False)]
        """
        from gradstats.plan.export.torchao_objects import to_torchao

        return to_torchao(self, model, emulate=emulate, strict=strict)


def _defaults_from_dict(d: Any) -> Rule:
    if not isinstance(d, Mapping):
        raise ValueError(f"defaults: expected an object of rule fields, got {type(d).__name__}")
    _check_keys(d, [k for k in RULE_FIELDS if k != "predicted"], "defaults")
    try:
        return Rule(**d)
    except ValueError as exc:
        raise _err("defaults", str(exc)) from None
