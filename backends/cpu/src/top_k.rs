//! Top-k selection: the indices of the `k` largest scores, sorted ascending (ties in any
//! order; a NaN ranks as negative infinity). [`top_k_reference`] is the plain rule (a full
//! sort); [`top_k`] finds the same set without sorting the input: a threshold from a sample,
//! then one pass; or a histogram.

/// The indices of the `k` largest of `score` (`k` capped at its length), ascending, into `out`;
/// `scratch` is working space.
///
/// From [`SAMPLED_FROM`] scores without a NaN, [`sampled`]; otherwise, or where the sample's
/// threshold lets fewer than `k` through, [`by_histogram`].
pub fn top_k(score: &[f32], k: usize, out: &mut Vec<u32>, scratch: &mut Vec<u32>) {
    let n = score.len();
    out.clear();
    scratch.clear();
    if k >= n {
        out.extend(0..n as u32);
        return;
    }
    if k == 0 {
        return;
    }
    if n >= SAMPLED_FROM && !score.iter().any(|v| v.is_nan()) && sampled(score, k, out, scratch) {
        return;
    }
    out.clear();
    scratch.clear();
    by_histogram(score, k, out, scratch)
}

/// A score as the selections order it: a NaN as negative infinity (below every number, where
/// the histogram's bins put it), all else by `total_cmp`.
fn rank(v: f32) -> f32 {
    if v.is_nan() {
        f32::NEG_INFINITY
    } else {
        v
    }
}

/// Scores from which [`top_k`] samples a threshold first.
pub const SAMPLED_FROM: usize = 1024;

/// Scores sampled for the threshold (every `n / SAMPLE`-th).
const SAMPLE: usize = 512;

/// [`top_k`] of finite or infinite scores (no NaN), 0 < k < n: the threshold `thr` is the
/// sample's score at place `ceil(1.15 m k / n) + 8` in descending order (`m` the sample's
/// length; so that `k` or more scores pass it but for rare samples), the indices of scores
/// `>= thr` are taken in one branch-free pass, and the k-th largest of theirs is found by
/// selection; then the indices above it, and those equal to it up to `k` (lowest first), in
/// index order. `false`, with `out` and `scratch` in any state, where fewer than `k` pass.
/// (The histogram took 44 us for 8192 scores: 6.6% of the samples of an 8-row sparse step of
/// synthetic OPT-1.3B.)
fn sampled(score: &[f32], k: usize, out: &mut Vec<u32>, scratch: &mut Vec<u32>) -> bool {
    let n = score.len();
    let by_score = |a: &f32, b: &f32| b.partial_cmp(a).unwrap_or(std::cmp::Ordering::Equal);
    let mut sample: Vec<f32> = score.iter().step_by((n / SAMPLE).max(1)).copied().collect();
    let place = (k as f64 / n as f64 * sample.len() as f64 * 1.15).ceil() as usize + 8;
    if place >= sample.len() {
        return false;
    }
    let thr = *sample.select_nth_unstable_by(place, by_score).1;
    scratch.resize(n, 0);
    let mut c = 0;
    for (i, &v) in score.iter().enumerate() {
        // Written always, kept when it passes (c <= i < n).
        scratch[c] = i as u32;
        c += (v >= thr) as usize;
    }
    if c < k {
        return false;
    }
    let mut vals: Vec<f32> = scratch[..c].iter().map(|&i| score[i as usize]).collect();
    let (above, &mut kth, _) = vals.select_nth_unstable_by(k - 1, by_score);
    let mut ties = k - above.iter().filter(|&&v| v > kth).count();
    for &i in &scratch[..c] {
        let v = score[i as usize];
        if v > kth || v == kth && ties > 0 {
            ties -= (v == kth) as usize;
            out.push(i);
        }
    }
    true
}

/// [`top_k`] by a histogram, 0 < k < n: a histogram of the scores over 4096 bins finds the
/// bin holding the k-th largest; every index above it is kept and the rest are chosen among
/// the boundary bin's by value. (A full `select_nth` over a 150k vocabulary took ~1 ms per
/// token.) Constant or non-finite scores: a plain selection.
fn by_histogram(score: &[f32], k: usize, out: &mut Vec<u32>, scratch: &mut Vec<u32>) {
    const BINS: usize = 4096;
    let n = score.len();
    let (lo, hi) = score
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &v| {
            (a.min(v), b.max(v))
        });
    let by_score = |&a: &u32, &b: &u32| rank(score[b as usize]).total_cmp(&rank(score[a as usize]));
    if hi.partial_cmp(&lo) != Some(std::cmp::Ordering::Greater)
        || !lo.is_finite()
        || !hi.is_finite()
    {
        // Constant or non-finite scores: a plain selection (NaN sorts last).
        scratch.extend(0..n as u32);
        scratch.select_nth_unstable_by(k - 1, by_score);
        out.extend_from_slice(&scratch[..k]);
        out.sort_unstable();
        return;
    }
    let scale = (BINS as f32 - 1.0) / (hi - lo);
    let bin = |v: f32| (((v - lo) * scale) as usize).min(BINS - 1);
    let mut hist = [0u32; BINS];
    score.iter().for_each(|&v| hist[bin(v)] += 1);
    // The boundary bin t: fewer than k scores lie above it, at least k at or above it.
    let (mut t, mut above) = (BINS - 1, 0usize);
    while above + (hist[t] as usize) < k {
        above += hist[t] as usize;
        t -= 1;
    }
    for (i, &v) in score.iter().enumerate() {
        let b = bin(v);
        if b > t {
            out.push(i as u32);
        } else if b == t {
            scratch.push(i as u32);
        }
    }
    let need = k - out.len();
    if need < scratch.len() {
        scratch.select_nth_unstable_by(need, by_score);
    }
    out.extend_from_slice(&scratch[..need]);
    out.sort_unstable();
}

/// The reference: a full sort by score (larger first, a NaN as negative infinity, ties by
/// lower index), the first `k`.
pub fn top_k_reference(score: &[f32], k: usize) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..score.len() as u32).collect();
    idx.sort_by(|&a, &b| {
        rank(score[b as usize])
            .total_cmp(&rank(score[a as usize]))
            .then(a.cmp(&b))
    });
    idx.truncate(k);
    idx.sort_unstable();
    idx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_picks_the_largest() {
        let s = [0.5, -3.0, 9.0, 1.0, 2.0, 7.0];
        let (mut out, mut scratch) = (Vec::new(), Vec::new());
        for (k, want) in [
            (3, &[2u32, 4, 5][..]),
            (1, &[2]),
            (0, &[]),
            (6, &[0, 1, 2, 3, 4, 5]),
        ] {
            top_k(&s, k, &mut out, &mut scratch);
            assert_eq!(out, want, "k {k}");
        }
    }

    /// The selection keeps the reference's scores on random, tied, outlier, constant and
    /// infinite inputs, on both paths (sampled, and the histogram where the sample misleads or
    /// a score is NaN); the same set where no scores tie at the boundary.
    #[test]
    fn top_k_matches_the_reference() {
        let mut state = 7u64;
        let mut rnd = || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
            (state >> 40) as f32 / (1u64 << 24) as f32
        };
        let (mut out, mut scratch) = (Vec::new(), Vec::new());
        for n in [1usize, 5, 100, 5000, 8192] {
            let stride = (n / SAMPLE).max(1);
            let cases: Vec<Vec<f32>> = vec![
                (0..n).map(|_| rnd() * 10.0 - 5.0).collect(),
                (0..n).map(|_| (rnd() * 4.0).floor()).collect(),
                (0..n)
                    .map(|_| if rnd() < 0.01 { 1e6 } else { rnd() })
                    .collect(),
                vec![2.5; n],
                // Infinities among the scores; then the sampled positions the largest (the
                // sample's threshold lets too few through: the histogram); then a NaN (the
                // histogram).
                (0..n)
                    .map(|i| match i % 97 {
                        3 => f32::INFINITY,
                        5 => f32::NEG_INFINITY,
                        _ => rnd(),
                    })
                    .collect(),
                (0..n)
                    .map(|i| if i % stride == 0 { 10.0 + rnd() } else { rnd() })
                    .collect(),
                (0..n)
                    .map(|i| if i == n / 2 { f32::NAN } else { rnd() })
                    .collect(),
            ];
            for (case, s) in cases.iter().enumerate() {
                // A NaN ranks as negative infinity.
                let s_ranked: Vec<f32> = s
                    .iter()
                    .map(|&v| if v.is_nan() { f32::NEG_INFINITY } else { v })
                    .collect();
                for k in [0, 1, n / 3, n.saturating_sub(1), n] {
                    top_k(s, k, &mut out, &mut scratch);
                    let want = top_k_reference(&s_ranked, k);
                    assert!(out.windows(2).all(|w| w[0] < w[1]), "ascending");
                    let scores = |v: &[u32]| {
                        let mut x: Vec<f32> = v.iter().map(|&i| s_ranked[i as usize]).collect();
                        x.sort_by(|a, b| b.total_cmp(a));
                        x.iter().map(|v| v.to_bits()).collect::<Vec<u32>>()
                    };
                    assert_eq!(scores(&out), scores(&want), "n {n} k {k}");
                    if case == 0 {
                        assert_eq!(out, want, "distinct scores: the same set");
                    }
                }
            }
        }
    }
}
