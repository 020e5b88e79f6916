"""Two exact building blocks of the Gram-space solvers: the projection onto the probability
simplex and a non-negative quadratic program (used by MGDA, UPGrad, CAGrad, MoDo, SDMGrad)."""

from __future__ import annotations

import numpy as np
import tensorflow as tf


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
