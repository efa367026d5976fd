//! The 3×3 linear algebra of the work model's ridge regression (no dependency for it).

pub(super) fn dot(a: &[f64; 3], b: &[f64; 3]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

pub(super) fn mul(a: &[[f64; 3]; 3], t: &[f64; 3]) -> [f64; 3] {
    let [r0, r1, r2] = a;
    [dot(r0, t), dot(r1, t), dot(r2, t)]
}

/// Solves `a·θ = b` with the coefficients not `free` held at 0 (their rows and columns replaced
/// by the identity), by Cramer's rule; `None` when (nearly) singular.
pub(super) fn solve_masked(a: &[[f64; 3]; 3], b: &[f64; 3], free: [bool; 3]) -> Option<[f64; 3]> {
    let mut m = [[0.0; 3]; 3];
    let mut rhs = [0.0; 3];
    for (i, ((row, src), fi)) in m.iter_mut().zip(a).zip(free).enumerate() {
        for (j, ((v, s), fj)) in row.iter_mut().zip(src).zip(free).enumerate() {
            *v = if fi && fj {
                *s
            } else if i == j {
                1.0
            } else {
                0.0
            };
        }
    }
    for ((r, v), f) in rhs.iter_mut().zip(b).zip(free) {
        *r = if f { *v } else { 0.0 };
    }
    let det = det3(&m);
    let scale = m.iter().flatten().fold(0.0f64, |acc, v| acc.max(v.abs()));
    if !det.is_finite() || det.abs() <= 1e-12 * scale.powi(3).max(1e-300) {
        return None;
    }
    let [c0, c1, c2] = [0usize, 1, 2].map(|k| {
        let mut mk = m;
        for (row, r) in mk.iter_mut().zip(rhs) {
            if let Some(v) = row.get_mut(k) {
                *v = r;
            }
        }
        det3(&mk) / det
    });
    Some([c0, c1, c2])
}

pub(super) fn det3(m: &[[f64; 3]; 3]) -> f64 {
    let [[a, b, c], [d, e, f], [g, h, i]] = *m;
    a * (e * i - f * h) - b * (d * i - f * g) + c * (d * h - e * g)
}
