"""Trust-region policy steps: Fisher-vector products, conjugate gradient, step scaling and line search.

TRPO (Schulman et al. 2015, arXiv 1502.05477) maximises a surrogate ``L(theta)`` subject to a bound on the
mean KL divergence between the old and the new policy::

    maximise L(theta)   subject to   KL(theta_old, theta) <= delta

With ``g = grad L`` and ``F`` the Hessian of the mean KL at ``theta_old`` (the Fisher information of the
policy), the step is the natural gradient ``s = F^-1 g`` found by conjugate gradient on Fisher-vector
products, scaled to the boundary of the quadratic trust region, ``step = sqrt(2 delta / s^T F s) * s``, and
then shrunk by a backtracking line search until the *measured* surrogate improves and the *measured* KL is
within ``delta``. If no candidate passes, the parameters are restored exactly.

Everything here is a pure function of tensors and callables and imports only ``torch``:

* :func:`flatten` / :func:`unflatten`: a parameter list as one vector and back.
* :func:`flat_grad`: the gradient of a scalar with respect to a parameter list, as one vector.
* :func:`fisher_vector_product_fn` / :func:`fisher_vector_product`: ``(F + damping I) v`` by double
  backpropagation through the KL, without forming ``F``.
* :func:`conjugate_gradient`: solves ``A x = b`` for a symmetric positive definite ``A`` given as a
  matrix-vector product, and reports its relative residual.
* :func:`scale_to_trust_region`: ``sqrt(2 delta / s^T F s) * s``.
* :func:`backtracking_line_search`: shrink, evaluate, accept or restore.
* :func:`trpo_step`: the whole policy step from the surrogate gradient and a Fisher-vector product.

Departures from the paper and choices:

* Damping: the product is ``(F + damping * I) v``. The damped matrix is positive definite even where ``F``
  is singular (a Fisher estimated from fewer samples than parameters always is), so CG is well posed.
  ``s^T F s`` in the step scale includes the damping, which makes the quadratic model's KL at the
  boundary slightly *below* ``delta``; the line search checks the measured KL anyway.
* The line search accepts the first candidate with a positive measured improvement and a measured KL of at
  most ``delta``. The original implementation also asked for a fraction (0.1) of the linearly expected
  improvement; ``accept_ratio`` offers that, and is 0 by default.
* Parameters are set to ``theta_old + fraction * step`` from a saved copy of ``theta_old`` for every
  candidate, never by adding and subtracting increments, so a rejected search leaves every parameter
  bit-identical to what it was.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

__all__ = [
    "flatten",
    "unflatten",
    "flat_grad",
    "fisher_vector_product_fn",
    "fisher_vector_product",
    "CGResult",
    "conjugate_gradient",
    "scale_to_trust_region",
    "LineSearchResult",
    "backtracking_line_search",
    "TRPOStepResult",
    "trpo_step",
]

Scalar = float | torch.Tensor


# ----------------------------------------------------------------------------
# flat vectors
# ----------------------------------------------------------------------------


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate tensors into one 1-D vector (row-major order of each tensor, in list order)."""
    if len(tensors) == 0:
        raise ValueError("flatten: got no tensors")
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Split a 1-D vector into tensors shaped like ``like`` (the inverse of :func:`flatten`).

    The results are views of ``flat``. Raises if the sizes do not add up.
    """
    if flat.dim() != 1:
        raise ValueError(f"unflatten: expected a 1-D vector, got shape {tuple(flat.shape)}")
    total = sum(t.numel() for t in like)
    if flat.numel() != total:
        raise ValueError(f"unflatten: vector has {flat.numel()} elements but the tensors hold {total}")
    out, offset = [], 0
    for t in like:
        out.append(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return out


def flat_grad(
    output: torch.Tensor,
    params: Sequence[torch.Tensor],
    retain_graph: bool = False,
    create_graph: bool = False,
) -> torch.Tensor:
    """``d output / d params`` as one vector; a parameter that ``output`` does not depend on gets zeros."""
    grads = torch.autograd.grad(
        output, list(params), retain_graph=retain_graph, create_graph=create_graph, allow_unused=True
    )
    return flatten([torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)])


# ----------------------------------------------------------------------------
# Fisher-vector products
# ----------------------------------------------------------------------------


def fisher_vector_product_fn(
    kl: torch.Tensor,
    params: Sequence[torch.Tensor],
    damping: float = 0.0,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function ``v -> (F + damping * I) v`` where ``F`` is the Hessian of the scalar ``kl`` w.r.t. ``params``.

    ``kl`` must be the mean KL between a *fixed* copy of the policy (detached) and the policy as a function
    of ``params``, evaluated where both coincide: there its gradient is 0 and its Hessian is the Fisher
    information. The first-order gradient graph is built once here (``create_graph=True``) and each call
    differentiates ``grad(kl) . v`` once more, so a call costs one extra backward pass and the graph stays
    alive for as long as the returned function does.

    Args:
        kl: scalar with a graph to ``params``.
        params: the parameters of the trust region (only those with ``requires_grad``).
        damping: ``>= 0``; added times ``v``.

    Returns:
        ``fvp(v)`` for a 1-D ``v`` of the flattened parameter size; returns a detached vector.
    """
    if kl.dim() != 0:
        raise ValueError(f"fisher_vector_product_fn: kl must be a scalar, got shape {tuple(kl.shape)}")
    if damping < 0:
        raise ValueError(f"fisher_vector_product_fn: damping must be >= 0, got {damping}")
    params = list(params)
    grad_kl = flat_grad(kl, params, retain_graph=True, create_graph=True)  # (P,)
    size = grad_kl.numel()

    def fvp(vector: torch.Tensor) -> torch.Tensor:
        if vector.shape != (size,):
            raise ValueError(f"fisher_vector_product: vector must have shape ({size},), got {tuple(vector.shape)}")
        vector = vector.detach().to(grad_kl.dtype)
        if not grad_kl.requires_grad:  # kl is constant in params: F = 0
            return damping * vector
        hv = flat_grad(grad_kl @ vector, params, retain_graph=True)  # (P,)
        return hv.detach() + damping * vector

    return fvp


def fisher_vector_product(
    kl: torch.Tensor,
    params: Sequence[torch.Tensor],
    vector: torch.Tensor,
    damping: float = 0.0,
) -> torch.Tensor:
    """``(F + damping * I) v`` for one vector; see :func:`fisher_vector_product_fn` (which reuses the graph)."""
    return fisher_vector_product_fn(kl, params, damping)(vector)


# ----------------------------------------------------------------------------
# conjugate gradient
# ----------------------------------------------------------------------------


class CGResult(NamedTuple):
    """Output of :func:`conjugate_gradient`.

    * ``solution``: ``x`` with ``A x ~ b``, 1-D.
    * ``residual``: relative residual ``||b - A x|| / ||b||`` of the returned ``x`` (0 for ``b = 0``), from
      the CG recurrence, which equals the true residual up to rounding.
    * ``iterations``: matrix-vector products spent.
    * ``converged``: the residual reached the tolerance.
    """

    solution: torch.Tensor
    residual: float
    iterations: int
    converged: bool


def conjugate_gradient(
    matvec: Callable[[torch.Tensor], torch.Tensor],
    b: torch.Tensor,
    max_iters: int = 10,
    tol: float = 1e-10,
) -> CGResult:
    """Solve ``A x = b`` for a symmetric positive definite ``A`` given as ``matvec(v) = A v``, from ``x = 0``.

    Hestenes and Stiefel's conjugate gradient. It stops after ``max_iters`` products or as soon as the
    relative residual ``||r|| / ||b||`` is at most ``tol``. A direction of non-positive curvature
    (``p^T A p <= 0``, impossible for SPD ``A`` but possible in floating point on a nearly singular one)
    stops the iteration with the current ``x``.
    """
    if b.dim() != 1:
        raise ValueError(f"conjugate_gradient: b must be 1-D, got shape {tuple(b.shape)}")
    if max_iters < 1:
        raise ValueError(f"conjugate_gradient: max_iters must be >= 1, got {max_iters}")
    if tol < 0:
        raise ValueError(f"conjugate_gradient: tol must be >= 0, got {tol}")
    b = b.detach()
    x = torch.zeros_like(b)
    r = b.clone()  # b - A x at x = 0
    p = r.clone()
    b_norm = float(b.norm())
    if b_norm == 0.0:
        return CGResult(x, 0.0, 0, True)
    rr = r @ r
    iterations = 0
    for _ in range(max_iters):
        if math.sqrt(float(rr)) / b_norm <= tol:
            break
        ap = matvec(p)
        iterations += 1
        curvature = p @ ap
        if not float(curvature) > 0.0:
            break
        alpha = rr / curvature
        x = x + alpha * p
        r = r - alpha * ap
        rr_new = r @ r
        p = r + (rr_new / rr) * p
        rr = rr_new
    residual = math.sqrt(float(rr)) / b_norm
    return CGResult(x, residual, iterations, residual <= tol)


# ----------------------------------------------------------------------------
# step scaling and line search
# ----------------------------------------------------------------------------


def scale_to_trust_region(
    direction: torch.Tensor,
    fisher_direction: torch.Tensor,
    max_kl: float,
) -> tuple[torch.Tensor, float]:
    """Scale ``direction`` ``s`` to the boundary of the quadratic trust region ``0.5 s^T F s = max_kl``.

    Args:
        direction: ``s``, 1-D (for TRPO the CG solution of ``F s = g``).
        fisher_direction: ``F s`` (the same product CG uses, damping included).
        max_kl: ``delta > 0``.

    Returns:
        ``(step, shs)``: ``sqrt(2 delta / shs) * s`` and ``shs = s^T F s``. A direction with ``shs <= 0`` or a
        non-finite one gives a zero step (there is no boundary to scale to).
    """
    if not max_kl > 0:
        raise ValueError(f"scale_to_trust_region: max_kl must be > 0, got {max_kl}")
    shs = float(direction @ fisher_direction)
    if not (math.isfinite(shs) and shs > 0.0):
        return torch.zeros_like(direction), shs
    return direction * math.sqrt(2.0 * max_kl / shs), shs


class LineSearchResult(NamedTuple):
    """Output of :func:`backtracking_line_search`.

    * ``accepted``: a candidate passed; the parameters hold it. Otherwise they hold ``theta_old`` exactly.
    * ``fraction``: the accepted multiple of the full step (0 when rejected).
    * ``steps``: candidates evaluated (1 when the full step was accepted).
    * ``improvement``: measured surrogate improvement of the accepted candidate (0 when rejected).
    * ``kl``: measured KL of the accepted candidate (0 when rejected: the policy did not move).
    * ``expected_improvement``: the linear model's ``g . (fraction * step)`` for the accepted candidate, or for
      the full step when rejected (``nan`` if not given).
    """

    accepted: bool
    fraction: float
    steps: int
    improvement: float
    kl: float
    expected_improvement: float


@torch.no_grad()
def _assign(params: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
    for p, v in zip(params, values):
        p.copy_(v)


def backtracking_line_search(
    params: Sequence[torch.Tensor],
    full_step: torch.Tensor,
    evaluate: Callable[[], tuple[Scalar, Scalar]],
    surrogate_before: Scalar,
    max_kl: float,
    expected_improvement: Scalar | None = None,
    backtrack_ratio: float = 0.5,
    max_backtracks: int = 10,
    accept_ratio: float = 0.0,
) -> LineSearchResult:
    """Try ``theta_old + f * full_step`` for ``f = 1, r, r**2, ...``; keep the first that passes, else restore.

    A candidate passes when its surrogate and KL are finite, the improvement ``surrogate - surrogate_before``
    is positive, the KL is at most ``max_kl``, and (with ``accept_ratio > 0`` and an
    ``expected_improvement``) the improvement is at least ``accept_ratio * f * expected_improvement``.

    Args:
        params: the parameters to move, in place (``theta_old`` on entry).
        full_step: 1-D, flattened like ``params`` (see :func:`flatten`).
        evaluate: called with the candidate in ``params``; returns ``(surrogate, kl)`` of that candidate,
            where the surrogate is to be *maximised* and the KL is measured against ``theta_old``.
        surrogate_before: the surrogate at ``theta_old``, measured the same way.
        max_kl: ``delta``.
        expected_improvement: ``g . full_step`` of the linear model, for ``accept_ratio`` and reporting.
        backtrack_ratio: ``r`` in ``(0, 1)``.
        max_backtracks: shrinks after the full step; ``max_backtracks + 1`` candidates at most.
        accept_ratio: required share of the linearly expected improvement (0: any positive improvement).
    """
    if not 0.0 < backtrack_ratio < 1.0:
        raise ValueError(f"backtracking_line_search: backtrack_ratio must be in (0, 1), got {backtrack_ratio}")
    if max_backtracks < 0:
        raise ValueError(f"backtracking_line_search: max_backtracks must be >= 0, got {max_backtracks}")
    if not max_kl > 0:
        raise ValueError(f"backtracking_line_search: max_kl must be > 0, got {max_kl}")
    if accept_ratio < 0:
        raise ValueError(f"backtracking_line_search: accept_ratio must be >= 0, got {accept_ratio}")
    params = list(params)
    steps = unflatten(full_step.detach(), params)
    saved = [p.detach().clone() for p in params]  # theta_old, restored bit for bit on rejection
    before = float(surrogate_before)
    expected = float("nan") if expected_improvement is None else float(expected_improvement)
    fraction = 1.0
    tried = 0
    for _ in range(max_backtracks + 1):
        tried += 1
        with torch.no_grad():
            for p, old, s in zip(params, saved, steps):
                p.copy_(old + fraction * s.to(old.dtype))
        surrogate, kl = evaluate()
        surrogate, kl = float(surrogate), float(kl)
        improvement = surrogate - before
        ok = math.isfinite(surrogate) and math.isfinite(kl) and improvement > 0.0 and kl <= max_kl
        if ok and accept_ratio > 0.0 and math.isfinite(expected):
            ok = improvement >= accept_ratio * fraction * expected
        if ok:
            return LineSearchResult(True, fraction, tried, improvement, kl, fraction * expected)
        fraction *= backtrack_ratio
    _assign(params, saved)
    return LineSearchResult(False, 0.0, tried, 0.0, 0.0, expected)


# ----------------------------------------------------------------------------
# the whole step
# ----------------------------------------------------------------------------


class TRPOStepResult(NamedTuple):
    """Diagnostics of one :func:`trpo_step` (all plain floats/ints/bools).

    * ``accepted``, ``kl``, ``improvement``, ``line_search_steps``, ``fraction``: from the line search.
    * ``expected_improvement``: the linear model's improvement of the full step, ``g . step``.
    * ``cg_residual``, ``cg_iterations``: from :func:`conjugate_gradient`.
    * ``shs``: ``s^T (F + damping I) s`` of the CG direction; ``step_norm``: ``||step||`` of the full step.
    """

    accepted: bool
    kl: float
    improvement: float
    expected_improvement: float
    line_search_steps: int
    fraction: float
    cg_residual: float
    cg_iterations: int
    shs: float
    step_norm: float


def trpo_step(
    params: Sequence[torch.Tensor],
    grad: torch.Tensor,
    fvp: Callable[[torch.Tensor], torch.Tensor],
    evaluate: Callable[[], tuple[Scalar, Scalar]],
    surrogate_before: Scalar,
    max_kl: float,
    cg_iters: int = 10,
    cg_tol: float = 1e-10,
    backtrack_ratio: float = 0.5,
    max_backtracks: int = 10,
    accept_ratio: float = 0.0,
) -> TRPOStepResult:
    """One TRPO policy step in place on ``params`` (arXiv 1502.05477, appendix C).

    Solves ``F s = g`` by CG, scales ``s`` to ``0.5 s^T F s = max_kl``, and line-searches along it
    (:func:`backtracking_line_search`). A zero gradient or a direction without positive curvature gives a
    rejected step and untouched parameters.

    Args:
        params: the trust region's parameters, at ``theta_old``; moved in place.
        grad: ``g``, the flattened gradient of the surrogate (to be maximised) at ``theta_old``.
        fvp: ``v -> (F + damping I) v`` (see :func:`fisher_vector_product_fn`).
        evaluate: ``() -> (surrogate, kl)`` at the current ``params``, see :func:`backtracking_line_search`.
        surrogate_before: the surrogate at ``theta_old`` as ``evaluate`` measures it.
        max_kl: ``delta``.
        cg_iters: see :func:`conjugate_gradient`.
        cg_tol: see :func:`conjugate_gradient`.
        backtrack_ratio: see :func:`backtracking_line_search`.
        max_backtracks: see :func:`backtracking_line_search`.
        accept_ratio: see :func:`backtracking_line_search`.
    """
    params = list(params)
    grad = grad.detach()
    cg = conjugate_gradient(fvp, grad, max_iters=cg_iters, tol=cg_tol)
    direction = cg.solution
    if cg.iterations == 0 or not bool(torch.isfinite(direction).all()):
        return TRPOStepResult(False, 0.0, 0.0, 0.0, 0, 0.0, cg.residual, cg.iterations, 0.0, 0.0)
    step, shs = scale_to_trust_region(direction, fvp(direction), max_kl)
    expected = float(grad @ step)
    if not float(step.abs().max()) > 0.0:
        return TRPOStepResult(False, 0.0, 0.0, expected, 0, 0.0, cg.residual, cg.iterations, shs, 0.0)
    search = backtracking_line_search(
        params, step, evaluate, surrogate_before, max_kl, expected, backtrack_ratio, max_backtracks, accept_ratio
    )
    return TRPOStepResult(
        search.accepted,
        search.kl,
        search.improvement,
        expected,
        search.steps,
        search.fraction,
        cg.residual,
        cg.iterations,
        shs,
        float(step.norm()),
    )
