"""Pure Gram-space solvers of the gradient-based methods (as optax's transforms).

Each takes the tasks' `T x T` Gram matrix (and the method's hyperparameters) and returns the
weights `beta` of the task gradients; the method classes (one file each, by LibMTL id) call
them. `_*_xla` are their XLA-compiled forms, used inside the step.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from keras_fastloop.weighting._simplex import nonnegative_quadratic, project_to_simplex

_EPS = 1e-8


# ------------------------------------------------------------------------------ pure solvers


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


# ------------------------------------------------------------ clipping of the combined update


def clip_factor(beta, gram, max_norm):
    """`min(1, max_norm / |d|)` for the update `d = sum_i beta_i g_i` (`|d|^2 = beta^T M beta`).

    `max_norm = 0` (or `None`) gives 1 (no clipping). Unlike `torch.nn.utils.clip_grad_norm_`
    (`max_norm / (|d| + 1e-6)`) a clipped update has norm `max_norm` exactly.
    """
    if not max_norm:
        return tf.ones((), beta.dtype)
    norm = tf.sqrt(tf.maximum(tf.reduce_sum(beta * tf.linalg.matvec(gram, beta)), 0.0))
    return tf.where(norm > max_norm, max_norm / tf.where(norm > 0.0, norm, 1.0), 1.0)


# ------------------------------------------------------------------------ FairGrad, SDMGrad


def fairgrad_weights(gram, alpha=1.0, max_iter=50, tolerance=1e-12):
    """FairGrad's weights: `x > 0` with `M x = x^(-1/alpha)` (element-wise).

    The alpha-fair allocation's optimality condition on the raw Gram matrix `M`
    (`alpha = 1` is Nash-MTL's equation). It is the stationarity condition of the strictly
    convex `F(x) = x^T M x / 2 - sum_i h(x_i)` with `h' = x^(-1/alpha)`, so the root is
    unique when it exists. Solved on `M_n = M / |M|_F` (root `a`) and rescaled:
    `x = a |M|_F^(-alpha / (1 + alpha))`. Damped Newton steps (`1 / (1 + lambda)` while the
    Newton decrement `lambda >= 1/4`, at most half of the way to the boundary `a = 0`) from
    `a_i = c M_n,ii^(-alpha / (1 + alpha))` (exact for orthogonal gradients) with the best
    scalar `c`, until `lambda^2 < tolerance` or `max_iter` steps. Ones when `M = 0`.

    Args:
        gram: `(T, T)` Gram matrix (float32 in the step; any float dtype).
        alpha: positive float, the fairness exponent.
        max_iter: Newton steps at most.
        tolerance: stop when the squared Newton decrement is below.

    Returns:
        `x` of shape `(T,)`.
    """
    t = gram.shape[0]
    dtype = gram.dtype
    alpha = float(alpha)
    p = 1.0 / alpha
    frobenius = tf.sqrt(tf.reduce_sum(tf.square(gram)))
    degenerate = frobenius <= 0.0
    m = tf.where(degenerate, tf.eye(t, dtype=dtype), gram / tf.where(degenerate, 1.0, frobenius))
    d = tf.pow(tf.maximum(tf.linalg.diag_part(m), 1e-30), -alpha / (1.0 + alpha))
    q = tf.maximum(tf.reduce_sum(d * tf.linalg.matvec(m, d)), 1e-30)
    c = tf.pow(tf.reduce_sum(tf.pow(d, 1.0 - p)) / q, alpha / (1.0 + alpha))

    def body(i, a, decrement):
        grad = tf.linalg.matvec(m, a) - tf.pow(a, -p)
        hessian = m + tf.linalg.diag(p * tf.pow(a, -p - 1.0))
        delta = -tf.linalg.solve(hessian, grad[:, None])[:, 0]
        lam2 = tf.maximum(-tf.reduce_sum(grad * delta), 0.0)
        step = tf.where(lam2 < 0.0625, tf.ones((), dtype), 1.0 / (1.0 + tf.sqrt(lam2)))
        room = tf.reduce_min(tf.where(delta < 0.0, -a / tf.where(delta < 0.0, delta, -1.0), 2.0))
        step = tf.minimum(step, 0.5 * room)
        return i + 1, a + step * delta, lam2

    def cond(i, a, decrement):
        return tf.logical_and(i < max_iter, decrement >= tolerance)

    _, a, _ = tf.while_loop(cond, body, (0, c * d, tf.constant(1.0, dtype)))
    x = a * tf.pow(tf.where(degenerate, tf.ones((), dtype), frobenius), -alpha / (1.0 + alpha))
    return tf.where(degenerate, tf.ones_like(x), x)


_fairgrad_weights_xla = tf.function(fairgrad_weights, jit_compile=True, autograph=False)


def sdmgrad_weights(cross, weights, lamda, niter, learning_rate=5.0, momentum=0.5):
    """SDMGrad's weights after `niter` projected SGD steps with momentum (LibMTL's inner loop).

    `C_ij = <g_i^(2), g_j^(3)>` is divided by `s^2 + 1e-8` with `s` the mean of
    `sqrt(max(C_ii, 0))`; each step takes `d = C w + lamda mean_j C_ij`,
    `b <- momentum b + d` (`b = d` at the first step, as `torch.optim.SGD`),
    `w <- Pi_simplex(w - learning_rate b)`. The momentum starts anew each call, `w` carries
    over (the method's state).
    """
    diag = tf.maximum(tf.linalg.diag_part(cross), 0.0)
    scale = tf.reduce_mean(tf.sqrt(diag))
    c = cross / (scale * scale + 1e-8)
    mean = tf.reduce_mean(c, axis=1)

    def body(i, w, buffer):
        d = tf.linalg.matvec(c, w) + lamda * mean
        buffer = momentum * buffer + d
        v = w - learning_rate * buffer
        # The projection is invariant to adding a constant; shifting the largest entry to 0
        # keeps its float32 sums exact when `C` is huge (a zero mean diagonal divides by 1e-8;
        # LibMTL projects in float64).
        return i + 1, project_to_simplex(v - tf.reduce_max(v)), buffer

    _, w, _ = tf.while_loop(lambda i, w, b: i < niter, body, (0, weights, tf.zeros_like(weights)))
    return w


_sdmgrad_weights_xla = tf.function(sdmgrad_weights, jit_compile=True, autograph=False)
