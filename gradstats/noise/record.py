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

Both are recorded per layer call on the trace's sampled steps for :class:`torch.nn.Linear` (the
first dimension of the input is the sample) and 1-d and 2-d convolutions; ``downstream_layers``
records which traced layers each layer's gradient flows back from (the autograd graph of one
step), so that the noise later layers add is carried to the layers before them.

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


def records_noise(module: nn.Module) -> bool:
    """Whether :func:`weight_grad_terms` covers ``module``: a Linear, or a 1-d or 2-d convolution
    with numeric zero padding.

    Example:
        >>> records_noise(torch.nn.Linear(2, 2)), records_noise(torch.nn.LSTM(2, 2))
        (True, False)
    """
    if type(module) is nn.Linear or isinstance(module, nn.Linear):
        return True
    conv = type(module) in _CONV
    return conv and module.padding_mode == "zeros" and not isinstance(module.padding, str)


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
    receives per unit of relative noise at ``m``. One partial backward pass per traced layer, once
    per run. While it runs, :attr:`busy` is True and the tracer's hooks record nothing.

    Example:
        >>> import torch
        >>> a, b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)
        >>> p = Propagation()
        >>> x = torch.randn(16, 4); h = a(x); p.keep("a", h, x); y = b(torch.tanh(h)); p.keep("b", y, h)
        >>> for name, t in (("b", y), ("a", h)):
        ...     _ = t.register_hook(lambda g, name=name: p.on_gradient(name, g, torch.Generator().manual_seed(0)))
        >>> y.square().sum().backward()
        >>> graph, gains = p.finish(step=0)
        >>> [r["layer"] for r in graph], [(r["source"], r["layer"]) for r in gains], gains[0]["gain"] > 0
        (['a', 'b'], [('b', 'a')], True)
    """

    def __init__(self) -> None:
        self.busy = False
        self.outputs: dict[str, torch.Tensor] = {}
        self.nodes_in: dict[str, Any] = {}
        self.down: dict[str, list[str]] | None = None
        self.arrived: dict[str, dict[str, float]] = {}
        self.own: dict[str, float] = {}

    def keep(self, name: str, out: torch.Tensor, x: Any) -> None:
        """In the forward pass: the layer's output (its first call) and its input's autograd node."""
        if name not in self.outputs and out.grad_fn is not None:
            self.outputs[name] = out
            self.nodes_in[name] = node_of(x)

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
        try:
            got = torch.autograd.grad(self.outputs[name], [self.outputs[n] for n in ups],
                                      grad_outputs=self._noise(g.detach(), generator), retain_graph=True,
                                      allow_unused=True)
        except RuntimeError as exc:      # a graph that cannot be walked twice: no gains, the prediction assumes 1
            log.warning("gradstats.trace: the noise propagation could not be measured (%s); predicted noise "
                        "assumes it reaches earlier layers unchanged", str(exc).splitlines()[0])
            self.arrived, self.outputs = {}, {}
            return
        finally:
            self.busy = False
            _SENDING_BACK[0] -= 1
        self.arrived[name] = {n: float(t.detach().float().square().sum()) for n, t in zip(ups, got) if t is not None}

    def finish(self, step: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """After the step's backward: the rows of the ``"noise_graph"`` table (layer, downstream)
        and of the ``"noise_gain"`` table (source, layer, gain); the kept tensors are released."""
        graph = [{"step": step, "layer": n, "downstream": json.dumps(d)} for n, d in (self.down or {}).items()]
        gains = [{"step": step, "source": m, "layer": l, "gain": a / self.own[l]}
                 for m, arr in self.arrived.items() for l, a in arr.items() if self.own.get(l, 0.0) > 0]
        self.outputs, self.nodes_in = {}, {}
        return graph, gains
