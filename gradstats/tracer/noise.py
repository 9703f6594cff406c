"""What a trace records so that the noise a plan adds can be predicted (the ``"noise"`` table).

A plan changes a layer's output gradient ``g``; the optimizer sees the weight gradient
``G = sum_r g_r x_r^T`` (rows ``r``: samples, tokens, spatial positions; ``x_r`` the input row or
convolution patch). Noise ``d_r`` added to ``g_r`` independently per entry, zero-mean, reaches the
weight gradient as ``E|sum_r d_r x_r^T|^2 = sum_r E|d_r|^2 |x_r|^2``; with ``E|d_r|^2 = e |g_r|^2``
(the operator's relative error ``e``) that is ``e * q2`` with

    q2 = sum_r |g_r|^2 |x_r|^2.

SGD's own noise is the minibatch variance of ``G`` at the batch size ``B``, ``tr(Cov)/B`` of the
per-sample gradients. With per-sample contributions ``G_i`` (``G = sum_i G_i``) and centred
Rademacher signs ``c_i = s_i - mean(s)``, ``S = sum_i c_i G_i`` is one more weight-gradient
product and ``E|S|^2 = sum_i |G_i|^2 - |G|^2 / B``, so

    minibatch noise = B / (B - 1) * E|S|^2 =: B / (B - 1) * s2.

Both are recorded per layer call on the trace's sampled steps, for every traced module with
trainable parameters (:func:`records_noise`), over the parameters :func:`noise_params` names. For
:class:`torch.nn.Linear` (the first dimension of the input is the sample) and 1-d and 2-d
convolutions they have closed forms in the layer's input and output gradient
(:func:`weight_grad_terms`, the weight alone). For any other module (a GRU, an Embedding, a
MultiheadAttention, a custom module; all its trainable parameters) they are vector-Jacobian
products through the module's own backward graph (:func:`vjp_terms`), both of the definitions
above read as one backward pass each: ``q2 = E_z |d<out, g*z>/dparams|^2`` with ``z`` standard normal
(one draw: noise of relative error 1 spread like ``g``; for a Linear its mean is the closed form),
and ``s2 = |d<out, g*c>/dparams|^2`` with the centred signs ``c`` over the samples (dim 0; dim 1 of an
``nn.RNN``/``LSTM``/``GRU`` with ``batch_first=False``). ``downstream_layers`` records which traced
layers each layer's gradient flows back from (the autograd graph of one step), so that the noise
later layers add is carried to the layers before them.

Example:
    >>> import torch
    >>> lin = torch.nn.Linear(3, 2)
    >>> x, g = torch.randn(8, 3), torch.randn(8, 2)
    >>> t = weight_grad_terms(lin, x, g, torch.Generator().manual_seed(0))
    >>> t["batch"], round(t["q2"], 6) == round(float((g.square().sum(1) * x.square().sum(1)).sum()), 6)
    (8, True)
"""
from __future__ import annotations

import json
import logging
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

log = logging.getLogger(__name__)

_CONV = {nn.Conv1d: (F.conv1d, torch.nn.grad.conv1d_weight), nn.Conv2d: (F.conv2d, torch.nn.grad.conv2d_weight)}


def has_closed_form(module: nn.Module) -> bool:
    """Whether :func:`weight_grad_terms` computes ``module``'s noise terms in closed form: a Linear,
    or a 1-d or 2-d convolution with numeric zero padding.

    Example:
        >>> has_closed_form(torch.nn.Linear(2, 2)), has_closed_form(torch.nn.GRU(2, 2))
        (True, False)
    """
    if type(module) is nn.Linear or isinstance(module, nn.Linear):
        return True
    conv = type(module) in _CONV
    return conv and module.padding_mode == "zeros" and not isinstance(module.padding, str)


def noise_params(module: nn.Module) -> list[torch.Tensor]:
    """The parameters whose gradient ``module``'s noise terms describe (the trace's records, the
    ``pair`` estimate, :func:`gradstats.noise_probe`): the weight of a layer with a closed form
    (:func:`has_closed_form`), else every trainable parameter of the module, its submodules' included
    (a GRU's ``weight_ih_l0``, ``weight_hh_l0``, biases; a MultiheadAttention's ``out_proj``, which it
    applies itself). Empty for a module with none.

    Example:
        >>> [p.shape for p in noise_params(torch.nn.Linear(3, 2))]
        [torch.Size([2, 3])]
        >>> len(noise_params(torch.nn.GRU(3, 2))), noise_params(torch.nn.ReLU())
        (4, [])
    """
    if has_closed_form(module):
        return [module.weight]
    return [p for p in module.parameters() if p.requires_grad]


def records_noise(module: nn.Module) -> bool:
    """Whether the trace records noise terms for ``module``: a layer with a closed form
    (:func:`has_closed_form`) or any module with trainable parameters (:func:`noise_params`,
    through :func:`vjp_terms`).

    Example:
        >>> records_noise(torch.nn.Linear(2, 2)), records_noise(torch.nn.LSTM(2, 2)), records_noise(torch.nn.ReLU())
        (True, True, False)
    """
    return has_closed_form(module) or any(p.requires_grad for p in module.parameters())


def sample_layout(module: nn.Module, output: Any, out: torch.Tensor) -> tuple[int, int | torch.Tensor | None]:
    """``(batch, where)``: how many samples ``module``'s output ``out`` (the first tensor of its
    ``output``) holds and where: the dim that indexes them (0; 1 for an ``nn.RNN``/``LSTM``/``GRU``
    with ``batch_first=False``), or, for a recurrent layer's packed sequence, the sample of each
    row; ``(1, None)`` for an unbatched output.

    Example:
        >>> gru = torch.nn.GRU(3, 4)
        >>> y = gru(torch.randn(5, 2, 3))
        >>> sample_layout(gru, y, y[0]), sample_layout(torch.nn.Linear(3, 4), None, torch.randn(6, 4))
        ((2, 1), (6, 0))
    """
    first = output[0] if isinstance(output, tuple) and output else output
    if isinstance(first, nn.utils.rnn.PackedSequence) and first.data is out:
        sizes = first.batch_sizes.to(torch.int64)
        starts = torch.cumsum(sizes, 0) - sizes
        index = torch.arange(int(sizes.sum())) - torch.repeat_interleave(starts, sizes)
        return int(sizes[0]), index.to(out.device)
    if isinstance(module, nn.RNNBase):
        if out.dim() != 3:
            return 1, None
        dim = 0 if module.batch_first else 1
        return int(out.shape[dim]), dim
    if out.dim() < 2:
        return 1, None
    return int(out.shape[0]), 0


def centred_signs(batch: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """``batch`` Rademacher signs minus their mean (float32, on ``device``).

    Example:
        >>> abs(float(centred_signs(7, torch.Generator().manual_seed(1), torch.device("cpu")).sum())) < 1e-6
        True
    """
    s = torch.randint(0, 2, (batch,), generator=generator, device=generator.device).to(device, torch.float32)
    s = 2.0 * s - 1.0
    return s - s.mean()


@torch.no_grad()
def weight_grad_terms(module: nn.Module, x: torch.Tensor, g: torch.Tensor,
                      generator: torch.Generator) -> dict[str, Any]:
    """``batch``, ``rows``, ``q2`` and ``s2`` (see the module docstring) of one call of ``module``
    with input ``x`` and output gradient ``g``.

    Example:
        >>> conv = torch.nn.Conv2d(2, 3, 3, padding=1)
        >>> t = weight_grad_terms(conv, torch.randn(4, 2, 5, 5), torch.randn(4, 3, 5, 5), torch.Generator())
        >>> t["batch"], t["rows"], t["q2"] > 0, t["s2"] >= 0
        (4, 100, True, True)
    """
    batch = int(x.shape[0]) if x.dim() >= 2 else 1
    c = centred_signs(batch, generator, x.device) if batch > 1 else torch.zeros(1, device=x.device)
    xf, gf = x.detach().float(), g.detach().float()
    if isinstance(module, nn.Linear):
        xr, gr = xf.reshape(-1, xf.shape[-1]), gf.reshape(-1, gf.shape[-1])
        rows = xr.shape[0]
        q2 = (gr.square().sum(1) * xr.square().sum(1)).sum()
        per = c.repeat_interleave(rows // batch) if rows % batch == 0 else c.new_zeros(rows)
        s2 = ((gr * per[:, None]).T @ xr).square().sum()
    else:
        conv, weight_grad = _CONV[type(module)]
        groups, n = module.groups, xf.shape[0]
        xs = xf.square().reshape(n, groups, -1, *xf.shape[2:]).sum(2)
        ones = xf.new_ones(groups, 1, *module.kernel_size)
        patch = conv(xs, ones, stride=module.stride, padding=module.padding, dilation=module.dilation,
                     groups=groups)
        gs = gf.square().reshape(n, groups, -1, *gf.shape[2:]).sum(2)
        q2 = (gs * patch).sum()
        rows = n * int(torch.tensor(gf.shape[2:]).prod()) if gf.dim() > 2 else n
        signed = gf * c.view(-1, *([1] * (gf.dim() - 1)))
        s2 = weight_grad(xf, module.weight.shape, signed, stride=module.stride, padding=module.padding,
                         dilation=module.dilation, groups=groups).square().sum()
    return {"batch": batch, "rows": int(rows), "q2": float(q2), "s2": float(s2)}


def _squared_norm_of_vjp(out: Any, v: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor | None:
    """``|d<out, v>/dparams|^2`` by a reentrant backward pass from ``out`` (a tensor or its
    ``GradientEdge``) on the retained graph; None when no parameter is reached. The tracer's and
    :func:`gradstats.apply`'s hooks leave it alone (:func:`sending_back`); no ``.grad`` is touched."""
    _SENDING_BACK[0] += 1
    try:
        got = torch.autograd.grad([out], params, grad_outputs=[v], retain_graph=True, allow_unused=True)
    finally:
        _SENDING_BACK[0] -= 1
    return squared_sum(got)


def squared_sum(grads: Any) -> torch.Tensor | None:
    """The summed squares of the gradients ``grads`` (None entries skipped; a sparse one, from an
    ``Embedding(sparse=True)``, with the rows of repeated indices added first); None when all are None.

    Example:
        >>> float(squared_sum([torch.ones(2, 2), None, torch.full((3,), 2.0)]))
        16.0
    """
    total = None
    for t in grads:
        if t is None:
            continue
        if t.is_sparse:
            t = t.coalesce().values()
        part = t.detach().float().square().sum()
        total = part if total is None else total + part
    return total


def vjp_terms(out: Any, g: torch.Tensor, params: list[torch.Tensor], generator: torch.Generator, *,
              batch: int, where: int | torch.Tensor | None) -> dict[str, Any] | None:
    """``batch``, ``rows``, ``q2`` and ``s2`` (module doc) of one call of a module whose output
    ``out`` (the tensor, or its ``torch.autograd.graph.GradientEdge`` taken in the forward pass) has
    the gradient ``g``, over ``params``, by two vector-Jacobian products through the module's own
    backward graph: ``q2`` from ``g`` times standard normal noise (one draw of an estimate whose
    mean is the definition), ``s2`` from ``g`` times centred signs over the samples (``batch`` of
    them, along the dim ``where`` or by the per-row sample index ``where``; :func:`sample_layout`).
    Call it while the graph is alive (in a tensor hook on ``out``, in the backward pass): it sends
    back on the retained graph and leaves the step's own gradients as they are. None when no
    parameter is reached from ``out``; a graph that cannot be walked again raises RuntimeError.

    Example:
        >>> lin = torch.nn.Linear(3, 2)
        >>> x, g = torch.randn(8, 3), torch.randn(8, 2)
        >>> t = vjp_terms(lin(x), g, [lin.weight], torch.Generator().manual_seed(0), batch=8, where=0)
        >>> t["batch"], t["rows"], t["q2"] > 0, t["s2"] > 0
        (8, 8, True, True)
    """
    v = g.detach()
    with torch.no_grad():
        z = torch.randn(v.shape, generator=generator, device=generator.device, dtype=torch.float32)
        noisy = v * z.to(v.device, v.dtype)
    q2 = _squared_norm_of_vjp(out, noisy, params)
    if q2 is None:
        return None
    s2 = None
    if batch > 1 and where is not None:
        c = centred_signs(batch, generator, v.device).to(v.dtype)
        if isinstance(where, torch.Tensor):           # a packed sequence: the sample of each row
            signs = c[where].view(-1, *([1] * (v.dim() - 1)))
        else:
            shape = [1] * v.dim()
            shape[where] = batch
            signs = c.view(shape)
        with torch.no_grad():
            signed = v * signs
        s2 = _squared_norm_of_vjp(out, signed, params)
    rows = v.numel() // v.shape[-1] if v.dim() >= 1 and v.shape[-1] else 1
    return {"batch": int(batch), "rows": int(rows), "q2": float(q2), "s2": 0.0 if s2 is None else float(s2)}


def flat_grad(params: list[torch.Tensor], dtype: torch.dtype = torch.float32,
              local: Any = None) -> torch.Tensor | None:
    """The gradients of ``params`` as one flat ``dtype`` copy (a parameter without one counts as
    zeros; a sparse one is made dense), or None when none has a gradient. ``local`` maps a gradient
    to the part this rank holds (the tracer's DTensor shards).

    Example:
        >>> gru = torch.nn.GRU(2, 3)
        >>> gru(torch.randn(4, 1, 2))[0].sum().backward()
        >>> flat_grad(noise_params(gru)).numel() == sum(p.numel() for p in gru.parameters())
        True
    """
    grads = [p.grad for p in params]
    if all(gr is None for gr in grads):
        return None
    parts = []
    for p, gr in zip(params, grads):
        if gr is None:
            parts.append(torch.zeros((local(p.detach()) if local else p).numel(), dtype=dtype, device=p.device))
            continue
        gr = local(gr) if local else gr
        gr = gr.to_dense() if gr.is_sparse else gr
        parts.append(gr.detach().reshape(-1).to(dtype))
    return torch.cat(parts) if len(parts) > 1 else parts[0].clone()


def node_of(t: Any) -> Any:
    """The autograd node that produced ``t`` (None for a leaf or a non-tensor)."""
    return getattr(t, "grad_fn", None) if isinstance(t, torch.Tensor) else None


def downstream_layers(outputs: dict[str, Any], inputs: dict[str, Any]) -> dict[str, list[str]]:
    """For each layer, the layers whose input depends on its output (so whose gradient noise flows
    back into its gradient), from the autograd nodes of one forward pass: ``outputs[name]`` the
    node of the layer's output, ``inputs[name]`` the node of its input (None: a leaf input).

    Example:
        >>> import torch
        >>> a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        >>> h = a(torch.randn(1, 2)); y = b(h.relu())
        >>> downstream_layers({"a": h.grad_fn, "b": y.grad_fn}, {"a": None, "b": h.relu().grad_fn})
        {'a': ['b'], 'b': []}
    """
    names = list(outputs)
    bit = {}
    for i, name in enumerate(names):
        node = outputs[name]
        if node is not None:
            bit[node] = bit.get(node, 0) | (1 << i)
    reach: dict[Any, int] = {}
    for name in names:               # iterative post-order walk, each node once
        start = inputs.get(name)
        if start is None or start in reach:
            continue
        stack = [(start, False)]
        while stack:
            node, done = stack.pop()
            if done:
                mask = bit.get(node, 0)
                for nxt, _ in node.next_functions:
                    if nxt is not None:
                        mask |= reach.get(nxt, 0)
                reach[node] = mask
                continue
            if node in reach:
                continue
            stack.append((node, True))
            for nxt, _ in node.next_functions:
                if nxt is not None and nxt not in reach:
                    stack.append((nxt, False))
    down: dict[str, list[str]] = {n: [] for n in names}
    for m in names:
        start = inputs.get(m)
        mask = reach.get(start, 0) if start is not None else 0
        for i, l in enumerate(names):
            if mask >> i & 1 and l != m:
                down[l].append(m)
    return down


_SENDING_BACK = [0]


def sending_back() -> bool:
    """True while a :class:`Propagation` sends noise back through a model: hooks that change or
    record gradients (the tracer's, :func:`gradstats.apply`'s) leave that noise alone.

    Example:
        >>> sending_back()
        False
    """
    return _SENDING_BACK[0] > 0


class Propagation:
    """How the noise added at one layer's output gradient reaches the others, measured once in a
    trace: on one sampled step, when the backward pass reaches layer ``m``, its output gradient
    ``g_m`` times standard normal noise (a relative error of 1, spread like the gradient) is sent
    back from ``m`` alone (a reentrant ``torch.autograd.grad`` on the retained graph; the step's own
    gradients are untouched), and what arrives at every layer ``l`` upstream is compared with
    ``l``'s own gradient: ``gain[m, l] = |J_ml^T (g_m * xi)|^2 / |g_l|^2``, the relative noise ``l``
    receives per unit of relative noise at ``m``. The same pass takes what it adds to the gradient
    of ``l``'s parameters (:func:`noise_params`, where :meth:`keep` was given them):
    ``weight_noise[m, l] = |dW_l|^2``. Noise that arrives from later layers is not independent per
    entry of ``g_l`` (the backward pass has mixed it), so it reaches the weight gradient otherwise
    than ``gain * q2`` says (:mod:`gradstats.noise.terms` reads the two together). One partial
    backward pass per traced layer, once per run. While it runs, :attr:`busy` is True and the
    tracer's hooks record nothing.

    Example:
        >>> import torch
        >>> a, b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)
        >>> p = Propagation()
        >>> x = torch.randn(16, 4); h = a(x); p.keep("a", h, x, [a.weight]); y = b(torch.tanh(h)); p.keep("b", y, h)
        >>> for name, t in (("b", y), ("a", h)):
        ...     _ = t.register_hook(lambda g, name=name: p.on_gradient(name, g, torch.Generator().manual_seed(0)))
        >>> y.square().sum().backward()
        >>> graph, gains = p.finish(step=0)
        >>> [r["layer"] for r in graph], [(r["source"], r["layer"]) for r in gains], gains[0]["gain"] > 0
        (['a', 'b'], [('b', 'a')], True)
        >>> gains[0]["weight_noise"] > 0
        True
    """

    def __init__(self) -> None:
        self.busy = False
        self.outputs: dict[str, torch.Tensor] = {}
        self.nodes_in: dict[str, Any] = {}
        self.down: dict[str, list[str]] | None = None
        self.arrived: dict[str, dict[str, float]] = {}
        self.weight_arrived: dict[str, dict[str, float]] = {}
        self.params: dict[str, list[torch.Tensor]] = {}
        self.own: dict[str, float] = {}

    def keep(self, name: str, out: torch.Tensor, x: Any, params: Any = ()) -> None:
        """In the forward pass: the layer's output (its first call), its input's autograd node and
        the parameters whose gradient its noise terms describe (those that require one)."""
        if name not in self.outputs and out.grad_fn is not None:
            self.outputs[name] = out
            self.nodes_in[name] = node_of(x)
            self.params[name] = [p for p in params if p.requires_grad]

    @torch.no_grad()
    def _noise(self, g: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        xi = torch.randn(g.shape, generator=generator, device=generator.device, dtype=torch.float32)
        return g * xi.to(g.device, g.dtype)

    def on_gradient(self, name: str, g: torch.Tensor, generator: torch.Generator) -> None:
        """In the backward pass, when layer ``name``'s output gradient ``g`` arrives."""
        if self.busy or name not in self.outputs or name in self.own:
            return
        if self.down is None:       # the step's whole graph exists now: which layer feeds which
            self.down = downstream_layers({n: t.grad_fn for n, t in self.outputs.items()}, self.nodes_in)
        self.own[name] = float(g.detach().float().square().sum())
        ups = [n for n, d in self.down.items() if name in d and n in self.outputs]
        if not ups or self.own[name] == 0.0:
            return
        self.busy = True
        _SENDING_BACK[0] += 1
        params = [p for n in ups for p in self.params.get(n, [])]
        try:
            got = torch.autograd.grad(self.outputs[name], [self.outputs[n] for n in ups] + params,
                                      grad_outputs=self._noise(g.detach(), generator), retain_graph=True,
                                      allow_unused=True)
        except RuntimeError as exc:      # a graph that cannot be walked twice: no gains, the prediction assumes 1
            log.warning("gradstats.trace: the noise propagation could not be measured (%s); predicted noise "
                        "assumes it reaches earlier layers unchanged", str(exc).splitlines()[0])
            self.arrived, self.weight_arrived, self.outputs = {}, {}, {}
            return
        finally:
            self.busy = False
            _SENDING_BACK[0] -= 1
        self.arrived[name] = {n: float(t.detach().float().square().sum()) for n, t in zip(ups, got) if t is not None}
        weights, i = {}, len(ups)
        for n in ups:
            k = len(self.params.get(n, []))
            total = squared_sum(got[i:i + k])
            i += k
            if total is not None:
                weights[n] = float(total)
        self.weight_arrived[name] = weights

    def finish(self, step: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """After the step's backward: the rows of the ``"noise_graph"`` table (layer, downstream)
        and of the ``"noise_gain"`` table (source, layer, gain, weight_noise: NaN where ``layer``'s
        parameters were not kept); the kept tensors are released."""
        graph = [{"step": step, "layer": n, "downstream": json.dumps(d)} for n, d in (self.down or {}).items()]
        gains = [{"step": step, "source": m, "layer": l, "gain": a / self.own[l],
                  "weight_noise": self.weight_arrived.get(m, {}).get(l, float("nan"))}
                 for m, arr in self.arrived.items() for l, a in arr.items() if self.own.get(l, 0.0) > 0]
        self.outputs, self.nodes_in, self.params = {}, {}, {}
        return graph, gains
