# Over 500 lines on purpose: eight methods of one family on one base class; each method's Gram-
# space solver sits next to the others it reuses (min-norm, simplex projection, quadratic program).
"""Gradient-based multi-task methods: GradNorm, PCGrad, CAGrad, MGDA, IMTL, Nash-MTL,
Aligned-MTL and UPGrad.

All of them act on the gradients of the *shared* variables and reduce to weights `beta` on the
task gradients: the shared variables get `sum_i beta_i g_i` and `beta` is a function of
the tasks' Gram matrix `M_ij = <g_i, g_j>` (plus the losses and the method's state). PCGrad's
sequential projections, for instance, only ever subtract multiples of original task gradients,
so they are tracked as coefficients in Gram space; UPGrad's projections onto the dual cone and
Aligned-MTL's singular-value alignment are likewise linear maps of the task gradients whose
coefficients follow from `M` alone. The step therefore never materialises a concatenated
gradient vector: `M` is summed variable by variable and the update is one weighted sum per
variable.

Cost. `GradientWeighting.gradients` runs one backward pass per task
(`tape.gradient(L_i, variables)`). That pass has to go through task `i`'s head to reach the
shared trunk anyway, so it also yields the head's own gradient for the price of the head's
weight-gradient products; heads are then weighted directly and no extra pass over the heads is
needed (cheaper than per-task passes over the shared variables followed by a separate combined
pass). Regularization losses get their own (cheap) pass through the step's `objective`, which
for these methods carries no task-loss gradient. Solvers run on `T x T` matrices.

Shared variables. By default, inferred at trace time: a trainable variable is shared when at
least two task losses reach it (`tape.gradient` with `UnconnectedGradients.NONE` returns
`None` for the others; this is structural, no extra work at run time). `compile(
shared_variables=[...])` (variables or layers) overrides the inference; only those enter the
Gram matrix, every other variable gets the heads' weighting.

Loss scale. Per-task gradients are taken with `output_gradients=s` where `s =
scale_loss(1.0)` is the optimizer's current loss scale (`LossScaleOptimizer` under
`mixed_float16`; 1 otherwise), i.e. they are exactly the gradients of `scale_loss(L_i)` and
fp16 backward passes are protected as usual. The Gram matrix is computed from `g_i / s` (the
solvers see true gradients; GradNorm's update is not scale-invariant), while the returned
gradients are `sum_i beta_i g_i` of the *scaled* ones, so the step's single unscale, finite
check and clipping apply unchanged. An overflowing task gradient makes `beta` non-finite and
the step skips the update; stateful methods commit state only in `update` (applied steps).

Distribution. Per-task shared gradients are summed across replicas before the Gram matrix, so
every replica computes the same `beta` from the global batch; the weighted local gradients
are then summed by the step as usual.

Heads and logs. Task-specific variables get the plain task gradient (weight 1) for PCGrad,
CAGrad, MGDA, IMTL-G, Nash-MTL, Aligned-MTL and UPGrad: their weights resolve conflicts on
shared parameters, and scaling a head's gradient would only change its learning rate. This is
what LibMTL does for all of them except Nash-MTL, whose reference code back-propagates
`sum_i alpha_i L_i` and so scales the heads by `alpha` too (see `docs/weighting.md`).
GradNorm gives the heads its loss weights `w` (the paper's objective `sum_i w_i L_i`;
LibMTL leaves them at 1) and IMTL the gradients of its scaled losses, `e^{s_i} g_i`. The
logged `{task}_weight` is `beta` (the effective weight of each task's shared gradient this
step; e.g. MGDA's alphas) and the logged `loss` is `sum_i head_weight_i L_i` +
regularization (plus IMTL's `-s_i` terms).
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from keras_fastloop import _keras_internals as internals
from keras_fastloop import _validation
from keras_fastloop._step import distributed
from keras_fastloop._step.state import state_variable
from keras_fastloop.weighting import _utils
from keras_fastloop.weighting.base import _PACKAGE, LossWeighting

_EPS = 1e-8


# ------------------------------------------------------------------------------ pure solvers


def project_to_simplex(v):
    """Euclidean projection of a vector onto the probability simplex (sort-based, exact)."""
    v = tf.convert_to_tensor(v)
    n = v.shape[-1]
    u = tf.sort(v, direction="DESCENDING")
    css = tf.cumsum(u)
    j = tf.range(1, n + 1, dtype=v.dtype)
    rho = tf.reduce_sum(tf.cast(u - (css - 1.0) / j > 0, tf.int32))
    rho = tf.maximum(rho, 1)
    theta = (tf.gather(css, rho - 1) - 1.0) / tf.cast(rho, v.dtype)
    return tf.maximum(v - theta, 0.0)


def pcgrad_weights(gram, order):
    """PCGrad as coefficients on the original task gradients.

    Args:
        gram: `(T, T)` float32 Gram matrix of the task gradients.
        order: `(T, T)` int tensor; row `i` is the random order in which task `i` visits
            the tasks (its own index is skipped).

    Returns:
        `beta` of shape `(T,)` with `sum_i g_i^PC = sum_j beta_j g_j`.
    """
    t = gram.shape[0]
    eye = tf.eye(t, dtype=gram.dtype)
    beta = tf.zeros((t,), gram.dtype)
    for i in range(t):
        c = eye[i]  # g_i^PC = sum_k c_k g_k
        for k in range(t):
            j = order[i, k]
            e_j = tf.gather(eye, j)
            dot = tf.reduce_sum(c * tf.gather(gram, j, axis=1))  # <g_i^PC, g_j>
            m_jj = tf.gather_nd(gram, tf.stack([j, j]))
            conflict = tf.logical_and(tf.not_equal(j, i), dot < 0.0)
            conflict = tf.logical_and(conflict, m_jj > 0.0)
            c = c - tf.where(conflict, dot / tf.where(m_jj > 0.0, m_jj, 1.0), 0.0) * e_j
        beta = beta + c
    return beta


def _min_norm_two(v1v1, v1v2, v2v2):
    """`gamma` minimising `|gamma v1 + (1 - gamma) v2|^2` over `[0, 1]`."""
    denom = v1v1 + v2v2 - 2.0 * v1v2
    gamma = tf.where(denom > 0.0, (v2v2 - v1v2) / tf.where(denom > 0.0, denom, 1.0), 0.5)
    return tf.clip_by_value(gamma, 0.0, 1.0)


def mgda_weights(gram, max_iter=250, tolerance=1e-5):
    """Min-norm point of the convex hull of the task gradients (MGDA-UB solver).

    Two tasks: the closed form `alpha_1 = clip((M22 - M12) / (M11 + M22 - 2 M12), 0, 1)`.
    More: Frank-Wolfe from the uniform point with exact line search, at most `max_iter`
    iterations, stopping when the L1 change of `alpha` is below `tolerance`.
    """
    t = gram.shape[0]
    if t == 2:
        a = _min_norm_two(gram[0, 0], gram[0, 1], gram[1, 1])
        return tf.stack([a, 1.0 - a])

    def body(i, alpha, change):
        m_alpha = tf.linalg.matvec(gram, alpha)
        k = tf.argmin(m_alpha, output_type=tf.int32)
        vv = tf.reduce_sum(alpha * m_alpha)
        vg = tf.gather(m_alpha, k)
        gg = tf.gather_nd(gram, tf.stack([k, k]))
        gamma = _min_norm_two(gg, vg, vv)  # weight on vertex k
        new = (1.0 - gamma) * alpha + gamma * tf.one_hot(k, t, dtype=gram.dtype)
        return i + 1, new, tf.reduce_sum(tf.abs(new - alpha))

    def cond(i, alpha, change):
        return tf.logical_and(i < max_iter, change >= tolerance)

    alpha0 = tf.fill((t,), 1.0 / t)
    _, alpha, _ = tf.while_loop(cond, body, (0, alpha0, tf.constant(1.0, gram.dtype)))
    return alpha


def min_norm_weights(gram):
    """Exact min-norm point of the convex hull of the task gradients (active-set solver).

    `argmin_{alpha in simplex} alpha^T M alpha` through the non-negative least-squares
    problem `z = argmin_{z >= 0} |G z|^2 + (1 - 1^T z)^2`, i.e. `nonnegative_quadratic`
    on `M + 1 1^T` with `c = -1`: its optimality conditions, `(M z)_i >= 1 - 1^T z` with
    equality where `z_i > 0`, are the simplex problem's for `alpha = z / 1^T z` (Lawson &
    Hanson's reduction of least-distance programming to NNLS). Exact up to float32 rounding
    (`|alpha - alpha*| <~ 3e-6` against a float64 enumeration of supports, up to 8 tasks).
    Computed on `M / mean(diag M)` (`alpha` is scale-free).
    """
    t = gram.shape[0]
    mean_diag = tf.reduce_mean(tf.linalg.diag_part(gram))
    m = gram / tf.where(mean_diag > 0.0, mean_diag, 1.0)
    z = nonnegative_quadratic(m + tf.ones((t, t), gram.dtype), -tf.ones((t,), gram.dtype))
    total = tf.reduce_sum(z)
    return tf.where(total > 0.0, z / tf.where(total > 0.0, total, 1.0), tf.fill((t,), 1.0 / t))


def cagrad_weights(gram, c=0.5, rescale=1, max_iter=100):
    """CAGrad's update as weights on the task gradients.

    Solves `min_{w in simplex} w^T M b + c |g0| sqrt(w^T M w + 1e-8)` (`b = 1/T`,
    `|g0| = sqrt(mean(M))`) in-graph by accelerated projected gradient descent (FISTA with
    restart on objective increase, step `q / (c' lambda_max)` from the local curvature, on
    `M / mean(diag M)`, whose argmin is the same) for `max_iter` iterations, keeping the best
    iterate. Tolerance, measured against SciPy's SLSQP (LibMTL's solver, best of several starts)
    on 200 random problems with 2-4 tasks and gradient norms spread over three decades: the
    resulting update `d` is within `1.1e-5 * rms |g_i|` at the default 100 iterations
    (`1.2e-6` at 200) in float64; the float32 solver in the step adds rounding of about
    `1e-4` relative (tests check `1e-3 * rms |g_i|` against SciPy). Then `d = g0 + (c |g0| / |g_w|) g_w`, divided by `1 + c^2`
    (`rescale=1`), `1 + c` (`2`) or not at all (`0`), as in LibMTL.

    Returns:
        `beta` of shape `(T,)` with `d = sum_i beta_i g_i`.
    """
    t = gram.shape[0]
    b = tf.fill((t,), 1.0 / t)
    divisor = {0: 1.0, 1: 1.0 + c**2, 2: 1.0 + c}[rescale]
    if c == 0:
        return b / divisor
    mn = gram / (tf.reduce_mean(tf.linalg.diag_part(gram)) + 1e-30)
    cn = c * tf.sqrt(tf.reduce_mean(mn) + _EPS)
    lam = tf.maximum(tf.reduce_max(tf.linalg.eigvalsh(mn)), 1e-12)
    mb = tf.linalg.matvec(mn, b)

    def norm_w(w):
        return tf.sqrt(tf.maximum(tf.reduce_sum(w * tf.linalg.matvec(mn, w)), 0.0) + _EPS)

    def objective(w):
        return tf.reduce_sum(w * mb) + cn * norm_w(w)

    def body(i, w, y, k, best, best_f):
        q = norm_w(y)
        grad = mb + cn * tf.linalg.matvec(mn, y) / q
        candidate = project_to_simplex(y - grad * q / (cn * lam))
        f_candidate, f_w = objective(candidate), objective(w)
        restart = f_candidate > f_w  # momentum overshoot: restart from w without momentum
        k_next = (1.0 + tf.sqrt(1.0 + 4.0 * k * k)) / 2.0
        y_next = candidate + (k - 1.0) / k_next * (candidate - w)
        w_new = tf.where(restart, w, candidate)
        better = tf.logical_and(tf.logical_not(restart), f_candidate < best_f)
        return (
            i + 1,
            w_new,
            tf.where(restart, w, y_next),
            tf.where(restart, 1.0, k_next),
            tf.where(better, candidate, best),
            tf.where(better, f_candidate, best_f),
        )

    init = (0, b, b, tf.constant(1.0), b, objective(b))
    *_, w, _ = tf.while_loop(lambda i, *_: i < max_iter, body, init, maximum_iterations=max_iter)
    g0_norm = tf.sqrt(tf.reduce_mean(gram) + _EPS)
    gw_norm = tf.sqrt(tf.maximum(tf.reduce_sum(w * tf.linalg.matvec(gram, w)), 0.0))
    lmbda = c * g0_norm / (gw_norm + _EPS)
    return (b + lmbda * w) / divisor


def imtl_weights(gram):
    """IMTL-G: the aggregate `sum_i alpha_i g_i` has equal projections on every unit `u_i`.

    With `D = [g_1 - g_i]`, `U = [u_1 - u_i]` (`i = 2..T`):
    `alpha_{2..T} = g_1 U^T (D U^T)^+` and `alpha_1 = 1 - sum alpha_{2..T}` (pseudo-inverse,
    so aligned tasks give a finite answer), computed from Gram entries only.
    """
    t = gram.shape[0]
    n = tf.sqrt(tf.maximum(tf.linalg.diag_part(gram), 1e-30))
    # (g_a . u_b) = M_ab / n_b
    gu = gram / n[None, :]
    g1u = gu[0, 0] - gu[0, 1:]  # g_1 . (u_1 - u_j)
    du = (gu[0, 0] - gu[0, 1:])[None, :] - (gu[1:, 0:1] - gu[1:, 1:])  # (g_1 - g_i).(u_1 - u_j)
    alpha = tf.linalg.matvec(tf.linalg.pinv(du), g1u, transpose_a=True)
    del t
    return tf.concat([[1.0 - tf.reduce_sum(alpha)], alpha], axis=0)


def gradnorm_update(weights, norms, losses, initial_losses, alpha, learning_rate):
    """One GradNorm step on the loss weights.

    `G_i = w_i |g_i|`, `r_i = (L_i / L_i(0)) / mean_j (L_j / L_j(0))`, target
    `Gbar r_i^alpha` (held constant), `L_grad = sum_i |G_i - target_i|`; then
    `w <- w - learning_rate * sign(G - target) * |g|`, clipped at `1e-6` and renormalised to
    sum to `T`.
    """
    t = weights.shape[0]
    g = weights * norms
    ratio = losses / tf.maximum(initial_losses, 1e-12)
    r = ratio / tf.maximum(tf.reduce_mean(ratio), 1e-12)
    target = tf.reduce_mean(g) * tf.pow(r, alpha)
    new = weights - learning_rate * tf.sign(g - target) * norms
    new = tf.maximum(new, 1e-6)
    return t * new / tf.reduce_sum(new)


def nash_mtl_weights(gram, max_iter=20, tolerance=1e-10):
    """Nash-MTL's bargaining weights: `alpha > 0` with `M alpha = 1 / alpha` (element-wise).

    `M` is the raw Gram matrix `G^T G`. Every task's directional improvement is then
    `<g_i, d> = (M alpha)_i = 1 / alpha_i` and the update `d = sum_i alpha_i g_i` has norm
    `|d|^2 = alpha^T M alpha = sum_i alpha_i (1 / alpha_i) = T`, whatever the gradients' scale
    (as the authors' and LibMTL's code compute it: they divide `M` by `n = |M|_F` but multiply
    `n` back inside their constraint `-log(alpha_i n) - log((M alpha / n)_i) <= 0`).

    For conditioning the equation is solved on `M_n = M / n`: its root `a` (`M_n a = 1 / a`)
    gives `alpha = a / sqrt(n)`, since `M (a / sqrt(n)) = sqrt(n) M_n a = sqrt(n) / a`. The
    normalised equation is the stationarity condition of the strictly convex
    `F(a) = a^T M_n a / 2 - sum_i log a_i` on `a > 0`, so its root is `F`'s unique minimiser.
    It is found by damped Newton steps (`a += delta / (1 + lambda)` while the Newton decrement
    `lambda >= 1/4`, full steps after; every iterate stays positive) from `a_i = c / sqrt(M_n,ii)`
    with the best scalar `c` (exact for orthogonal gradients), stopping when `lambda^2 <
    tolerance` or after `max_iter` steps. When a convex combination of the gradients is zero (a
    Pareto-stationary point) no root exists; the iterates then grow along that combination,
    which leaves the update bounded.

    Args:
        gram: `(T, T)` float32 Gram matrix `M = G^T G` of the task gradients.
        max_iter: Newton steps at most (default 20).
        tolerance: stop when the squared Newton decrement is below (default `1e-10`).

    Returns:
        `alpha` of shape `(T,)` solving `M alpha = 1 / alpha` (ones when every gradient is
        zero).
    """
    t = gram.shape[0]
    frobenius = tf.sqrt(tf.reduce_sum(tf.square(gram)))
    degenerate = frobenius <= 0.0
    m = tf.where(
        degenerate, tf.eye(t, dtype=gram.dtype), gram / tf.where(degenerate, 1.0, frobenius)
    )
    d = tf.math.rsqrt(tf.maximum(tf.linalg.diag_part(m), 1e-30))
    c = tf.sqrt(t / tf.maximum(tf.reduce_sum(d * tf.linalg.matvec(m, d)), 1e-30))

    def body(i, alpha, decrement):
        grad = tf.linalg.matvec(m, alpha) - 1.0 / alpha
        hessian = m + tf.linalg.diag(1.0 / tf.square(alpha))
        delta = -tf.linalg.solve(hessian, grad[:, None])[:, 0]
        lam2 = tf.maximum(-tf.reduce_sum(grad * delta), 0.0)
        lam = tf.sqrt(lam2)
        step = tf.where(lam < 0.25, 1.0, 1.0 / (1.0 + lam))
        return i + 1, alpha + step * delta, lam2

    def cond(i, alpha, decrement):
        return tf.logical_and(i < max_iter, decrement >= tolerance)

    _, alpha, _ = tf.while_loop(cond, body, (0, c * d, tf.constant(1.0, gram.dtype)))
    alpha = alpha * tf.math.rsqrt(tf.where(degenerate, 1.0, frobenius))  # the raw equation's root
    return tf.where(degenerate, tf.ones_like(alpha), alpha)


_ALIGNED_SCALE_MODES = ("min", "median", "rmse")


def aligned_mtl_weights(gram, scale_mode="min"):
    """Aligned-MTL: the task gradients' matrix with all singular values set to one scale.

    With `G = [g_1 .. g_T] = U S V^T` (thin SVD over the `r` non-negligible singular
    values; `M = V S^2 V^T`), the aligned matrix is `sigma U V^T = G V (sigma / S) V^T`
    and the update is its column sum, so `beta = V diag(sigma / S) V^T 1`. The scale
    `sigma` follows the authors' `scale_mode`: `"min"` the smallest kept singular value,
    `"median"` the square root of the median kept eigenvalue of `M` (the lower median for an
    even count, as `torch.median`), `"rmse"` the square root of their mean. Eigenvalues of
    `M` at or below `max(eig) * T * eps_float32` are dropped (the rank cut), as in the
    authors' and LibMTL's code. Computed from `M / trace(M)` (`beta` is scale-free). Zeros
    when every gradient is zero.

    Args:
        gram: `(T, T)` float32 Gram matrix.
        scale_mode: `"min"` (default), `"median"` or `"rmse"`.

    Returns:
        `beta` of shape `(T,)`.
    """
    t = gram.shape[0]
    trace = tf.linalg.trace(gram)
    m = gram / tf.where(trace > 0.0, trace, 1.0)
    eigenvalues, vectors = tf.linalg.eigh(m)
    keep = eigenvalues > tf.reduce_max(eigenvalues) * t * np.finfo(np.float32).eps
    sigma = tf.sqrt(tf.where(keep, eigenvalues, 1.0))
    if scale_mode == "min":
        scale = tf.reduce_min(tf.where(keep, sigma, np.inf))
    elif scale_mode == "median":
        rank = tf.reduce_sum(tf.cast(keep, tf.int32))
        ascending = tf.sort(tf.where(keep, eigenvalues, np.inf))
        scale = tf.sqrt(tf.gather(ascending, tf.maximum(rank - 1, 0) // 2))
    elif scale_mode == "rmse":
        rank = tf.maximum(tf.reduce_sum(tf.cast(keep, gram.dtype)), 1.0)
        scale = tf.sqrt(tf.reduce_sum(tf.where(keep, eigenvalues, 0.0)) / rank)
    else:
        raise ValueError(
            f"`scale_mode` must be one of {_ALIGNED_SCALE_MODES}. Received: "
            f"scale_mode={scale_mode!r}"
        )
    coefficients = tf.where(keep, scale / sigma, 0.0)
    beta = tf.linalg.matvec(vectors, coefficients * tf.reduce_sum(vectors, axis=0))
    return tf.where(trace > 0.0, beta, tf.zeros_like(beta))


def nonnegative_quadratic(m, c, max_iter=None, tolerance=1e-6):
    """`argmin_{z >= 0} z^T M z / 2 + c^T z` (Lawson & Hanson's active-set method, Gram form).

    Exact (up to float rounding) once the right free set is found; every outer iteration frees
    the coordinate with the largest descent, the inner loop keeps the iterate feasible.

    Args:
        m: `(T, T)` symmetric positive (semi-)definite matrix.
        c: `(T,)` linear term.
        max_iter: outer iterations at most (default `3 T`).
        tolerance: a coordinate is freed while its negative gradient exceeds this.

    Returns:
        `z` of shape `(T,)`.
    """
    t = m.shape[0]
    max_iter = 3 * t if max_iter is None else max_iter
    eye = tf.eye(t, dtype=m.dtype)
    index = tf.range(t)

    def solve_free(free):
        both = tf.logical_and(free[:, None], free[None, :])
        a = tf.where(both, m, eye)
        s = tf.linalg.solve(a, tf.where(free, -c, 0.0)[:, None])[:, 0]
        return tf.where(free, s, 0.0)

    def descent(z):
        return -(tf.linalg.matvec(m, z) + c)

    def inner_body(n, z, free, done):
        s = solve_free(free)
        ok = tf.reduce_all(tf.logical_or(tf.logical_not(free), s > 0.0))
        bad = tf.logical_and(free, s <= 0.0)
        gap = z - s
        ratio = tf.where(tf.logical_and(bad, gap > 0.0), z / tf.where(gap > 0.0, gap, 1.0), 0.0)
        ratio = tf.where(bad, ratio, np.inf)
        alpha = tf.clip_by_value(tf.reduce_min(ratio), 0.0, 1.0)
        leaving = tf.argmin(ratio, output_type=tf.int32)
        moved = z + alpha * (s - z)
        still = tf.logical_and(tf.logical_and(free, moved > 0.0), tf.not_equal(index, leaving))
        new_free = tf.where(ok, free, still)
        new_z = tf.where(ok, s, tf.where(still, moved, 0.0))
        return n + 1, new_z, new_free, ok

    def outer_cond(k, z, free):
        w = descent(z)
        return tf.logical_and(
            k < max_iter, tf.reduce_any(tf.logical_and(tf.logical_not(free), w > tolerance))
        )

    def outer_body(k, z, free):
        w = descent(z)
        j = tf.argmax(tf.where(free, -np.inf, w), output_type=tf.int32)
        free = tf.logical_or(free, tf.equal(index, j))
        _, z, free, _ = tf.while_loop(
            lambda n, z, free, done: tf.logical_and(tf.logical_not(done), n <= t),
            inner_body,
            (0, z, free, tf.constant(False)),
        )
        return k + 1, z, free

    init = (0, tf.zeros((t,), m.dtype), tf.zeros((t,), tf.bool))
    _, z, _ = tf.while_loop(outer_cond, outer_body, init)
    return z


def upgrad_weights(gram, norm_eps=1e-4, reg_eps=1e-4, pref_vector=None):
    """UPGrad: each task gradient projected onto the dual cone of all of them, combined.

    The dual cone is `{x : <g_j, x> >= 0 for all j}`. By Quinton & Rey's Proposition 1 the
    projection of `sum_j u_j g_j` is `sum_j v_j g_j` with `v = argmin_{v >= u} v^T M v`;
    UPGrad sums the projections of `p_1 g_1 .. p_T g_T` (`u = p_i e_i`) for the preference
    vector `p` (default `1/T`, the mean of the projections), so `beta = sum_i v^(i)`. As in `torchjd`, `M` is first divided by its trace (set to zero when the
    trace is below `norm_eps`) and `reg_eps * I` is added; each quadratic program is solved
    exactly by `nonnegative_quadratic` (`v = e_i + z`). Without conflicts
    (`M_ij >= 0`) every projection is the gradient itself and `beta = 1/T`.

    Args:
        gram: `(T, T)` float32 Gram matrix.
        norm_eps: non-negative float, default `1e-4`.
        reg_eps: non-negative float, default `1e-4`.
        pref_vector: `None` (default, `1/T` each) or `T` floats, the weights `p` that combine
            the projections (`torchjd`'s `pref_vector`).

    Returns:
        `beta` of shape `(T,)`.
    """
    t = gram.shape[0]
    if pref_vector is None:
        pref = tf.fill((t,), tf.constant(1.0 / t, gram.dtype))
    else:
        pref = tf.cast(tf.convert_to_tensor(pref_vector), gram.dtype)
    trace = tf.linalg.trace(gram)
    m = tf.where(trace < norm_eps, tf.zeros_like(gram), gram / tf.where(trace > 0.0, trace, 1.0))
    m = m + reg_eps * tf.eye(t, dtype=gram.dtype)
    eye = tf.eye(t, dtype=gram.dtype)
    total = tf.zeros((t,), gram.dtype)
    for i in range(t):
        u = pref[i] * eye[i]
        total = total + u + nonnegative_quadratic(m, tf.linalg.matvec(m, u))
    return total


# The iterative solvers run as one XLA cluster inside the step: a loop of tiny T x T ops costs
# one kernel launch instead of hundreds of op dispatches (3x faster CAGrad steps on CPU).
_cagrad_weights_xla = tf.function(cagrad_weights, jit_compile=True, autograph=False)
_mgda_weights_xla = tf.function(mgda_weights, jit_compile=True, autograph=False)
_min_norm_weights_xla = tf.function(min_norm_weights, jit_compile=True, autograph=False)
_nash_mtl_weights_xla = tf.function(nash_mtl_weights, jit_compile=True, autograph=False)
_upgrad_weights_xla = tf.function(upgrad_weights, jit_compile=True, autograph=False)


# ------------------------------------------------------------------------------ the base


def _resolve_shared(model, shared):
    if shared is None:
        return None
    if not isinstance(shared, (list, tuple)) or not shared:
        raise ValueError(
            "`shared_variables` must be None or a non-empty list of variables or layers. "
            f"Received: shared_variables={shared!r}"
        )
    variables = []
    for item in shared:
        if isinstance(item, keras.layers.Layer):
            variables.extend(item.trainable_variables)
        else:
            variables.append(item)
    trainable = {id(v) for v in model.trainable_variables}
    unknown = [getattr(v, "path", repr(v)) for v in variables if id(v) not in trainable]
    if unknown:
        raise ValueError(
            "Every entry of `shared_variables` must be a trainable variable (or layer) of the "
            f"model. Received: shared_variables with unknown entries {unknown}"
        )
    return variables


class GradientWeighting(LossWeighting):
    """Base of gradient-based methods: per-task gradients, Gram matrix, weights `beta`.

    Subclasses implement `task_weights` and optionally `head_weights`.
    """

    requires_task_gradients = True

    def validate(self, model, task_names, shared_variables=None):
        super().validate(model, task_names, shared_variables)
        if model.built:
            _resolve_shared(model, shared_variables)

    def build(self, model, state, task_names, static_weights):
        super().build(model, state, task_names, static_weights)
        step = getattr(model, "fastloop_step", None)
        self._given_shared = _resolve_shared(model, getattr(step, "shared_variables", None))
        self.shared_variable_paths = None  # set when the step is traced

    def head_weights(self):
        """Weights of the task-specific variables' gradients (default: 1 per task)."""
        return ops.ones((self.num_tasks,), "float32")

    def combine(self, losses):
        value = ops.sum(ops.stack(losses) * self.head_weights())
        return ops.stop_gradient(value), self.read_weights()

    def task_weights(self, gram, losses):
        """`beta` (shape `(T,)`) from the Gram matrix and the global losses."""
        raise NotImplementedError

    def _shared_indices(self, per_task, variables):
        if self._given_shared is not None:
            given = {id(v) for v in self._given_shared}
            shared = [k for k, v in enumerate(variables) if id(v) in given]
        else:
            shared = [
                k
                for k in range(len(variables))
                if sum(grads[k] is not None for grads in per_task) >= 2
            ]
        if not shared:
            raise ValueError(
                f"Gradient-based loss weighting '{self.name}' needs variables shared by at least "
                "two tasks, but no trainable variable is reached by more than one task loss. "
                "Pass `shared_variables` to `compile()` or use a loss-based method. "
                f"Received: tasks={self.task_names}"
            )
        self.shared_variable_paths = [variables[k].path for k in shared]
        return shared

    def gradients(self, tape, losses, objective, variables, scale_loss):
        variables = list(variables)
        scale = ops.cast(scale_loss(ops.ones((), "float32")), "float32")
        none = tf.UnconnectedGradients.NONE
        per_task = [
            [
                None if g is None else tf.convert_to_tensor(g)  # IndexedSlices -> dense
                for g in tape.gradient(
                    loss, variables, output_gradients=scale, unconnected_gradients=none
                )
            ]
            for loss in losses
        ]
        shared = self._shared_indices(per_task, variables)
        flat = []
        for k in shared:
            rows = [
                ops.zeros((int(np.prod(variables[k].shape)),), "float32")
                if grads[k] is None
                else ops.reshape(ops.cast(grads[k], "float32"), (-1,))
                for grads in per_task
            ]
            flat.append(ops.stack(rows) / scale)
        flat = distributed.all_reduce_sum(flat)
        gram = ops.sum(ops.stack([ops.matmul(f, ops.transpose(f)) for f in flat]), axis=0)
        global_losses = distributed.all_reduce_sum([ops.cast(loss, "float32") for loss in losses])
        beta = self.task_weights(gram, ops.stack(global_losses))
        self.weights.assign(beta)
        head = self.head_weights()
        regularization = tape.gradient(objective, variables, unconnected_gradients=none)
        shared = set(shared)
        result = []
        for k in range(len(variables)):
            w = beta if k in shared else head
            terms = [
                ops.cast(w[i], grads[k].dtype) * grads[k]
                for i, grads in enumerate(per_task)
                if grads[k] is not None
            ]
            if regularization[k] is not None:
                terms.append(regularization[k])
            result.append(ops.sum(ops.stack(terms), axis=0) if terms else None)
        return result


# ------------------------------------------------------------------------------ the methods


@keras.saving.register_keras_serializable(package=_PACKAGE)
class GradNorm(GradientWeighting):
    """Gradient normalization: learn loss weights that equalise the tasks' training rates.

    Algorithm (Chen et al.'s Eqs. 1-2 and Algorithm 1), every step with loss weights `w`
    (sum `T`, start at 1), shared-gradient norms `|g_i|` and losses `L_i` (`L_i(0)`
    recorded at the first applied step)::

        G_i = w_i |g_i|,  r_i = (L_i / L_i(0)) / mean_j (L_j / L_j(0))
        L_grad = sum_i |G_i - mean(G) r_i^alpha|          (the target held constant)
        dL_grad/dw_i = sign(G_i - target_i) |g_i|
        w <- renormalise_T(max(w - learning_rate * dL_grad/dw, 1e-6))

    i.e. one plain gradient step on `L_grad` with respect to `w` (the paper leaves that
    optimizer open), the floor keeping `w` positive, then the paper's renormalisation to sum
    `T`. The update uses this step's `w`; the new `w` is committed after the update is
    applied (skipped steps leave it unchanged). Every variable, shared or not, gets
    `sum_i w_i g_i` (the paper's objective `sum_i w_i L_i` back-propagated to the whole
    network). The norms are taken over all shared variables (LibMTL); the paper uses the last
    shared layer only, which `compile(shared_variables=[that_layer])` reproduces. Assigning
    `weights` mid-`fit` sets the next step's weights.

    LibMTL differs: its weights are `T * softmax(logits)` with the logits trained on
    `L_grad` by the network's own optimizer (learning rate included), it trains the first
    epoch with equal weights and takes `L_i(0)` as that epoch's mean loss, and its heads get
    the plain task gradient (weight 1). See `docs/weighting.md`.

    Args:
        alpha: non-negative float, default `1.5`: strength of the restoring force.
        learning_rate: positive float, default `0.025`: step size of the weight update.

    Example:
        >>> model.compile("adam", losses, loss_weighting=GradNorm(alpha=1.5))

    Reference:
        Chen, Badrinarayanan, Lee & Rabinovich, "GradNorm: Gradient Normalization for Adaptive
        Loss Balancing in Deep Multitask Networks", ICML 2018.
    """

    name = "gradnorm"

    def __init__(self, alpha: float = 1.5, learning_rate: float = 0.025) -> None:
        super().__init__()
        self.alpha = _utils.check_positive(alpha, "alpha", allow_zero=True)
        self.learning_rate = _utils.check_positive(learning_rate, "learning_rate")

    def build(self, model, state, task_names, static_weights):
        super().build(model, state, task_names, static_weights)
        t = (len(task_names),)
        self.initial_losses = state_variable(state, "gradnorm_initial_losses", t, 1.0)
        self.initialized = state_variable(state, "gradnorm_initialized", (), 0.0)
        self.pending = state_variable(state, "gradnorm_pending", t, 1.0)

    def head_weights(self):
        return self.read_weights()

    def task_weights(self, gram, losses):
        weights = self.read_weights()
        initial = ops.where(ops.greater(self.initialized, 0.0), self.initial_losses, losses)
        norms = ops.sqrt(ops.maximum(tf.linalg.diag_part(gram), 0.0))
        self.pending.assign(
            gradnorm_update(weights, norms, losses, initial, self.alpha, self.learning_rate)
        )
        return weights

    def update(self, losses):
        first = ops.equal(self.initialized, 0.0)
        self.initial_losses.assign(
            ops.where(first, _utils.update_losses(losses), self.initial_losses)
        )
        self.initialized.assign(1.0)
        self.weights.assign(self.pending)

    def get_config(self):
        return {"alpha": self.alpha, "learning_rate": self.learning_rate}


@keras.saving.register_keras_serializable(package=_PACKAGE)
class PCGrad(GradientWeighting):
    """Projecting conflicting gradients ("gradient surgery").

    Algorithm: for every task `i`, `g_i^PC = g_i`; for every other task `j` in a random
    order, if `<g_i^PC, g_j> < 0`: `g_i^PC -= <g_i^PC, g_j> / |g_j|^2 g_j`. The shared
    variables get `sum_i g_i^PC`, computed exactly as `sum_j beta_j g_j` (the logged weights;
    1 each without conflicts). The order comes from a stateless generator keyed by
    `(seed, step)` with `step` a checkpointed counter of applied updates.

    Args:
        seed: int or `None` (default: drawn from Python's `random`, which
            `keras.utils.set_random_seed` seeds). Stored in the config.

    Example:
        >>> model.compile("adam", losses, loss_weighting=PCGrad(seed=0))

    Reference:
        Yu, Kumar, Gupta, Levine, Hausman & Finn, "Gradient Surgery for Multi-Task Learning",
        NeurIPS 2020.
    """

    name = "pcgrad"

    def __init__(self, seed: int | None = None) -> None:
        super().__init__()
        self.seed = _utils.resolve_seed(seed)

    def build(self, model, state, task_names, static_weights):
        super().build(model, state, task_names, static_weights)
        self.step = state_variable(state, "pcgrad_step", (), 0, "int64")

    def task_weights(self, gram, losses):
        t = self.num_tasks
        keys = tf.random.stateless_uniform((t, t), seed=_utils.stateless_seed(self.seed, self.step))
        order = tf.cast(tf.argsort(keys, axis=1), "int32")
        return pcgrad_weights(gram, order)

    def update(self, losses):
        self.step.assign_add(1)

    def get_config(self):
        return {"seed": self.seed}


@keras.saving.register_keras_serializable(package=_PACKAGE)
class CAGrad(GradientWeighting):
    """Conflict-averse gradient descent.

    Algorithm: with `g0` the average task gradient, find the update `d` that maximises the
    worst task's improvement `min_i <g_i, d>` within `|d - g0| <= c |g0|`. Its dual is
    `min_{w in simplex} <g_w, g0> + c |g0| |g_w|` (`g_w = sum_i w_i g_i`), solved in-graph
    by projected gradient descent (see `cagrad_weights` for the tolerance), then
    `d = (g0 + c |g0| / |g_w| g_w) / (1 + c^2)` (LibMTL's default rescaling).

    Args:
        c: non-negative float, default `0.5`: radius of the ball around `g0` (`0` = `ew`
            on the shared parameters, scaled by `1/T`).
        rescale: int in `{0, 1, 2}`, default `1`: divide `d` by 1, `1 + c^2` or `1 + c`.
        max_iter: positive int, default `100`: solver iterations.

    Example:
        >>> model.compile("adam", losses, loss_weighting=CAGrad(c=0.5))

    Reference:
        Liu, Liu, Jin, Stone & Liu, "Conflict-Averse Gradient Descent for Multi-task Learning",
        NeurIPS 2021.
    """

    name = "cagrad"

    def __init__(self, c: float = 0.5, rescale: int = 1, max_iter: int = 100) -> None:
        super().__init__()
        self.c = _utils.check_positive(c, "c", allow_zero=True)
        if rescale not in (0, 1, 2) or isinstance(rescale, bool):
            raise ValueError(f"`rescale` must be 0, 1 or 2. Received: rescale={rescale!r}")
        self.rescale = rescale
        self.max_iter = _utils.check_positive_int(max_iter, "max_iter")

    def task_weights(self, gram, losses):
        return _cagrad_weights_xla(gram, self.c, self.rescale, self.max_iter)

    def get_config(self):
        return {"c": self.c, "rescale": self.rescale, "max_iter": self.max_iter}


_MGDA_NORMALIZATIONS = ("none", "l2", "loss", "loss+")
_MGDA_SOLVERS = ("active_set", "frank_wolfe")


@keras.saving.register_keras_serializable(package=_PACKAGE)
class MGDA(GradientWeighting):
    """Multiple-gradient descent: the min-norm convex combination of the task gradients.

    Algorithm: `alpha = argmin_{alpha in simplex} |sum_i alpha_i g_i / n_i|^2` with the
    normaliser `n_i` of `gradient_normalization`; closed form for two tasks, otherwise the
    exact active-set solver (`min_norm_weights`, default) or Sener & Koltun's
    Frank-Wolfe iteration (their Algorithm 2, exact line search, as LibMTL; it stops when
    `sum |delta alpha| < tolerance`, which can leave `alpha` a few 1e-2 from the optimum).
    The shared variables get `sum_i (alpha_i / n_i) g_i`; the logged weights are
    `alpha_i / n_i` (= `alpha` with the default `"none"`).

    Args:
        gradient_normalization: one of `"none"` (default, LibMTL), `"l2"` (`|g_i|`),
            `"loss"` (`L_i`), `"loss+"` (`L_i |g_i|`).
        solver: `"active_set"` (default, exact) or `"frank_wolfe"` (`T > 2`).
        max_iter: positive int, default `250`: Frank-Wolfe iterations.
        tolerance: positive float, default `1e-5`: Frank-Wolfe's stopping threshold.

    Example:
        >>> model.compile("adam", losses, loss_weighting="mgda")

    Reference:
        Sener & Koltun, "Multi-Task Learning as Multi-Objective Optimization", NeurIPS 2018.
    """

    name = "mgda"

    def __init__(
        self,
        gradient_normalization: str = "none",
        solver: str = "active_set",
        max_iter: int = 250,
        tolerance: float = 1e-5,
    ) -> None:
        super().__init__()
        if gradient_normalization not in _MGDA_NORMALIZATIONS:
            raise ValueError(
                f"`gradient_normalization` must be one of {_MGDA_NORMALIZATIONS}. "
                f"Received: gradient_normalization={gradient_normalization!r}"
            )
        if solver not in _MGDA_SOLVERS:
            raise ValueError(
                f"`solver` must be one of {_MGDA_SOLVERS}. Received: solver={solver!r}"
            )
        self.gradient_normalization = gradient_normalization
        self.solver = solver
        self.max_iter = _utils.check_positive_int(max_iter, "max_iter")
        self.tolerance = _utils.check_positive(tolerance, "tolerance")

    def task_weights(self, gram, losses):
        norms = ops.sqrt(ops.maximum(tf.linalg.diag_part(gram), 1e-30))
        n = {
            "none": ops.ones_like(norms),
            "l2": norms,
            "loss": losses,
            "loss+": losses * norms,
        }[self.gradient_normalization]
        n = ops.maximum(n, 1e-12)
        gram = gram / (n[:, None] * n[None, :])
        if self.num_tasks == 2:
            alpha = mgda_weights(gram)
        elif self.solver == "active_set":
            alpha = _min_norm_weights_xla(gram)
        else:
            alpha = _mgda_weights_xla(gram, self.max_iter, self.tolerance)
        return alpha / n

    def get_config(self):
        return {
            "gradient_normalization": self.gradient_normalization,
            "solver": self.solver,
            "max_iter": self.max_iter,
            "tolerance": self.tolerance,
        }


@keras.saving.register_keras_serializable(package=_PACKAGE)
class IMTLG(GradientWeighting):
    """Impartial multi-task learning, gradient part only (IMTL-G, `imtl_g`).

    Algorithm: find `alpha` (summing to 1) such that the aggregate `g = sum_i alpha_i g_i`
    has the same projection on every task's unit gradient `u_i = g_i / |g_i|`; closed form
    `alpha_{2..T} = g_1 U^T (D U^T)^{-1}`, `alpha_1 = 1 - sum alpha_{2..T}` with
    `D = [g_1 - g_i]`, `U = [u_1 - u_i]` (see `imtl_weights`; a pseudo-inverse, so
    aligned tasks give a finite answer). The logged weights are `alpha`; heads get weight 1.
    The full method of the paper, with IMTL-L's learned loss scales, is `imtl`
    (`IMTL`).

    Example:
        >>> model.compile("adam", losses, loss_weighting="imtl_g")

    Reference:
        Liu, Li, Kuang, Xue, Chen, Yang, Liao & Zhang, "Towards Impartial Multi-task Learning",
        ICLR 2021 (Section 3.2, IMTL-G).
    """

    name = "imtl_g"

    def task_weights(self, gram, losses):
        return imtl_weights(gram)


@keras.saving.register_keras_serializable(package=_PACKAGE)
class IMTL(GradientWeighting):
    """Impartial multi-task learning, the hybrid of the paper (IMTL-L + IMTL-G, `imtl`).

    Algorithm, with one trainable loss scale `s_i` per task (start 0):

    - IMTL-L: every task's loss becomes `e^{s_i} L_i - s_i`. The `s_i` are trained by the
      model's optimizer on the gradient of that scaled loss, `e^{s_i} L_i - 1` (its minimum
      over `s_i` is at `e^{s_i} = 1 / L_i`: every scaled loss is pushed towards 1).
    - IMTL-G on the scaled losses' gradients `e^{s_i} g_i`: `alpha` summing to 1 with
      equal projections of `sum_i alpha_i e^{s_i} g_i` on every unit gradient
      (`imtl_weights` on `diag(e^s) M diag(e^s)`).

    The shared variables get `sum_i alpha_i e^{s_i} g_i` (logged `{task}_weight` =
    `alpha_i e^{s_i}`, the weight of the raw gradient `g_i`); task-specific variables get
    the scaled loss' gradient `e^{s_i} g_i`. The `s_i` are created with
    `model.add_weight` (name `imtl_loss_scales`), saved with the model and trained with
    its learning rate; the `- s_i` term is divided by the number of replicas like any
    regularization loss. The paper applies IMTL-G to the gradients with respect to the shared
    *representation*; here (as LibMTL's default) to the shared *parameters*.

    Example:
        >>> model.compile("adam", losses, loss_weighting="imtl")

    Reference:
        Liu, Li, Kuang, Xue, Chen, Yang, Liao & Zhang, "Towards Impartial Multi-task Learning",
        ICLR 2021 (Algorithm 1, IMTL); LibMTL's `IMTL`.
    """

    name = "imtl"

    def __init__(self) -> None:
        super().__init__()
        self.loss_scales = None

    def build(self, model, state, task_names, static_weights):
        from keras_fastloop.weighting.uncertainty import _model_variable

        super().build(model, state, task_names, static_weights)
        self.loss_scales = _model_variable(model, "imtl_loss_scales", (len(task_names),), 0.0)

    def _scales(self):
        return ops.exp(ops.cast(ops.convert_to_tensor(self.loss_scales), "float32"))

    def head_weights(self):
        return ops.stop_gradient(self._scales())

    def combine(self, losses):
        s = ops.cast(ops.convert_to_tensor(self.loss_scales), "float32")
        scaled = ops.exp(s) * ops.stop_gradient(ops.stack(losses))
        # Gradient for s only (the network's gradients come from the per-task passes).
        objective = ops.sum(scaled) - internals.scale_loss_for_distribution(ops.sum(s))
        return objective, self.read_weights()

    def task_weights(self, gram, losses):
        scales = self._scales()
        alpha = imtl_weights(gram * scales[:, None] * scales[None, :])
        return alpha * scales


def clip_factor(beta, gram, max_norm):
    """`min(1, max_norm / |d|)` for the update `d = sum_i beta_i g_i` (`|d|^2 = beta^T M beta`).

    `max_norm = 0` (or `None`) gives 1 (no clipping). Unlike `torch.nn.utils.clip_grad_norm_`
    (`max_norm / (|d| + 1e-6)`) a clipped update has norm `max_norm` exactly.
    """
    if not max_norm:
        return tf.ones((), beta.dtype)
    norm = tf.sqrt(tf.maximum(tf.reduce_sum(beta * tf.linalg.matvec(gram, beta)), 0.0))
    return tf.where(norm > max_norm, max_norm / tf.where(norm > 0.0, norm, 1.0), 1.0)


@keras.saving.register_keras_serializable(package=_PACKAGE)
class NashMTL(GradientWeighting):
    """Nash-MTL: the Nash bargaining solution between tasks (`nash_mtl`).

    Algorithm: the update of the shared variables is `d = sum_i alpha_i g_i` with `alpha > 0`
    solving `(G^T G) alpha = 1 / alpha` (element-wise) on the raw Gram matrix, i.e. every
    task's directional improvement `<g_i, d>` equals `1 / alpha_i` (proportional fairness),
    and `|d| = sqrt(T)` whatever the gradients' scale, as in the authors' and LibMTL's code.
    Solved exactly in-graph by damped Newton iterations (on `G^T G / |G^T G|_F` for
    conditioning, then rescaled; see `nash_mtl_weights`); the paper approximates it by a
    sequence of convex programs with a CVXPY solver, at most 20 of them by default. Then, as
    the reference does, the *shared* update is clipped to norm `max_norm` (the heads'
    gradients are not). The logged weights are `alpha` times that clip factor (the weight each
    task's shared gradient gets this step). Heads get weight 1 (the reference code gives them
    `alpha_i`, unclipped); regularization gradients are added after the clip.

    With `update_weights_every=k`, `alpha` is recomputed on applied steps `0, k, 2k, ...` and
    held in between (a state variable `nash_mtl_alpha`, saved and restored with the model;
    the clip is applied every step to that step's gradients). The task gradients are still
    computed every step (the Gram matrix feeds the clip), so `k > 1` saves only the solve.

    Args:
        max_iter: positive int, default `20`: Newton steps at most.
        max_norm: non-negative float or `None`, default `1.0`: clip the shared update to
            this norm (LibMTL's `max_norm`); `0` or `None` disables the clip.
        update_weights_every: positive int, default `1`: recompute `alpha` every this many
            applied steps (LibMTL's `update_weights_every`).

    Raises:
        ValueError: at construction, for a `max_iter` or `update_weights_every` that is not a
            positive int, or a negative or non-numeric `max_norm`.

    Example:
        >>> model.compile("adam", losses, loss_weighting=NashMTL(max_norm=1.0))

    Reference:
        Navon, Shamsian, Achituve, Maron, Kawaguchi, Chechik & Fetaya, "Multi-Task Learning as a
        Bargaining Game", ICML 2022.
    """

    name = "nash_mtl"

    def __init__(
        self, max_iter: int = 20, max_norm: float | None = 1.0, update_weights_every: int = 1
    ) -> None:
        super().__init__()
        self.max_iter = _utils.check_positive_int(max_iter, "max_iter")
        self.max_norm = (
            0.0 if max_norm is None else _utils.check_positive(max_norm, "max_norm", True)
        )
        self.update_weights_every = _utils.check_positive_int(
            update_weights_every, "update_weights_every"
        )

    def build(self, model, state, task_names, static_weights):
        super().build(model, state, task_names, static_weights)
        t = (len(task_names),)
        self.alpha = state_variable(state, "nash_mtl_alpha", t, 1.0)
        self.pending_alpha = state_variable(state, "nash_mtl_pending_alpha", t, 1.0)
        self.step = state_variable(state, "nash_mtl_step", (), 0, "int64")

    def task_weights(self, gram, losses):
        if self.update_weights_every == 1:
            alpha = _nash_mtl_weights_xla(gram, self.max_iter)
        else:
            alpha = tf.cond(
                tf.equal(self.step % self.update_weights_every, 0),
                lambda: _nash_mtl_weights_xla(gram, self.max_iter),
                lambda: tf.identity(self.alpha.value),
            )
        self.pending_alpha.assign(alpha)
        return alpha * clip_factor(alpha, gram, self.max_norm)

    def update(self, losses):
        self.alpha.assign(self.pending_alpha)
        self.step.assign_add(1)

    def get_config(self):
        return {
            "max_iter": self.max_iter,
            "max_norm": self.max_norm,
            "update_weights_every": self.update_weights_every,
        }


@keras.saving.register_keras_serializable(package=_PACKAGE)
class AlignedMTL(GradientWeighting):
    """Aligned-MTL: align the principal components of the task gradients (`aligned_mtl`).

    Algorithm: with the task-gradient matrix `G = U S V^T`, replace it by the aligned
    `sigma_min U V^T` (every singular value set to the smallest non-negligible one, which
    makes the linear system's condition number 1) and update with its column sum (equal task
    weights `w = 1`), i.e. `beta = sigma_min V S^{-1} V^T 1` from the eigen-decomposition
    of the Gram matrix (`aligned_mtl_weights`). Orthogonal gradients of norms `n_i` get
    `beta_i = min(n) / n_i`. Heads get weight 1.

    Args:
        scale_mode: `"min"` (default), `"median"` or `"rmse"`: the common singular value,
            as the authors' `scale_mode`: the smallest kept one, the square root of the
            (lower) median or of the mean of the kept eigenvalues of `G^T G`.

    Raises:
        ValueError: at construction, for another `scale_mode`.

    Example:
        >>> model.compile("adam", losses, loss_weighting=AlignedMTL(scale_mode="min"))

    Reference:
        Senushkin, Patakin, Kuznetsov & Konushin, "Independent Component Alignment for
        Multi-Task Learning", CVPR 2023.
    """

    name = "aligned_mtl"

    def __init__(self, scale_mode: str = "min") -> None:
        super().__init__()
        if scale_mode not in _ALIGNED_SCALE_MODES:
            raise ValueError(
                f"`scale_mode` must be one of {_ALIGNED_SCALE_MODES}. "
                f"Received: scale_mode={scale_mode!r}"
            )
        self.scale_mode = scale_mode

    def task_weights(self, gram, losses):
        return aligned_mtl_weights(gram, self.scale_mode)

    def get_config(self):
        return {"scale_mode": self.scale_mode}


@keras.saving.register_keras_serializable(package=_PACKAGE)
class UPGrad(GradientWeighting):
    """UPGrad: unconflicting projection of gradients (`upgrad`, the `torchjd` aggregator).

    Algorithm: project every task gradient `g_i` onto the dual cone of all of them,
    `{x : <g_j, x> >= 0 for all j}` (so the projection conflicts with no task), and update
    with their combination by the preference vector `p` (default `1/T` each: their mean).
    Each projection is a small quadratic program on the Gram matrix, solved exactly in-graph
    (`upgrad_weights`); without conflicts the update is `sum_i p_i g_i` (`beta = p`).
    Heads get weight 1.

    Args:
        pref_vector: `None` (default: `1/T` each) or a list of `T` finite floats (`torchjd`'s
            `pref_vector`), checked against the number of tasks at `compile()`.
        norm_eps: non-negative float, default `1e-4`: a Gram matrix whose trace is below is
            treated as zero (`torchjd`'s default).
        reg_eps: non-negative float, default `1e-4`: `reg_eps * I` is added to the
            trace-normalised Gram matrix (`torchjd`'s default; `0` = the exact projection).

    Raises:
        ValueError: at construction, for a `pref_vector` that is not a list of finite
            numbers or negative `norm_eps` / `reg_eps`; at `compile()`, for a `pref_vector`
            whose length is not the number of tasks.

    Example:
        >>> model.compile("adam", losses, loss_weighting=UPGrad(pref_vector=[0.5, 0.5]))

    Reference:
        Quinton & Rey, "Jacobian Descent for Multi-Objective Optimization", arXiv:2406.16232,
        2024 (UPGrad; the `torchjd` library's aggregator).
    """

    name = "upgrad"

    def __init__(
        self,
        pref_vector: list[float] | None = None,
        norm_eps: float = 1e-4,
        reg_eps: float = 1e-4,
    ) -> None:
        super().__init__()
        if pref_vector is not None:
            values = list(pref_vector) if isinstance(pref_vector, (list, tuple, np.ndarray)) else []
            ok = bool(values) and all(
                _validation.is_real(v) and np.isfinite(float(v)) for v in values
            )
            if not ok or np.ndim(pref_vector) != 1:
                raise ValueError(
                    "`pref_vector` must be None or a list of finite numbers, one per task. "
                    f"Received: pref_vector={pref_vector!r}"
                )
            pref_vector = [float(v) for v in values]
        self.pref_vector = pref_vector
        self.norm_eps = _utils.check_positive(norm_eps, "norm_eps", allow_zero=True)
        self.reg_eps = _utils.check_positive(reg_eps, "reg_eps", allow_zero=True)

    def check_tasks(self, task_names):
        super().check_tasks(task_names)
        if self.pref_vector is not None and len(self.pref_vector) != len(task_names):
            raise ValueError(
                f"`pref_vector` must have one entry per task ({len(task_names)} tasks: "
                f"{list(task_names)}). Received: pref_vector={self.pref_vector!r}"
            )

    def task_weights(self, gram, losses):
        pref = None if self.pref_vector is None else tuple(self.pref_vector)
        return _upgrad_weights_xla(gram, self.norm_eps, self.reg_eps, pref)

    def get_config(self):
        return {"pref_vector": self.pref_vector, "norm_eps": self.norm_eps, "reg_eps": self.reg_eps}
