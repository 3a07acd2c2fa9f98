//! Top-k selection: the indices of the `k` largest scores, sorted ascending (ties in any
//! order). [`top_k_reference`] is the plain rule (a full sort); [`top_k`] finds the same set in
//! two passes without sorting the input.

/// The indices of the `k` largest of `score` (`k` capped at its length), ascending, into `out`;
/// `scratch` is working space.
///
/// Two passes, no sort of the whole input: a histogram of the scores over 4096 bins finds the
/// bin holding the k-th largest; every index above it is kept and the rest are chosen among the
/// boundary bin's by value. (A full `select_nth` over a 150k vocabulary took ~1 ms per token.)
pub fn top_k(score: &[f32], k: usize, out: &mut Vec<u32>, scratch: &mut Vec<u32>) {
    const BINS: usize = 4096;
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
    let (lo, hi) = score
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &v| {
            (a.min(v), b.max(v))
        });
    let by_score = |&a: &u32, &b: &u32| score[b as usize].total_cmp(&score[a as usize]);
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

/// The reference: a full sort by score (larger first, ties by lower index), the first `k`.
pub fn top_k_reference(score: &[f32], k: usize) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..score.len() as u32).collect();
    idx.sort_by(|&a, &b| {
        score[b as usize]
            .total_cmp(&score[a as usize])
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

    /// The histogram selection keeps the reference's scores on random, tied, outlier and
    /// constant inputs (the same set where no scores tie at the boundary).
    #[test]
    fn top_k_matches_the_reference() {
        let mut state = 7u64;
        let mut rnd = || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
            (state >> 40) as f32 / (1u64 << 24) as f32
        };
        let (mut out, mut scratch) = (Vec::new(), Vec::new());
        for n in [1usize, 5, 100, 5000] {
            let cases: Vec<Vec<f32>> = vec![
                (0..n).map(|_| rnd() * 10.0 - 5.0).collect(),
                (0..n).map(|_| (rnd() * 4.0).floor()).collect(),
                (0..n)
                    .map(|_| if rnd() < 0.01 { 1e6 } else { rnd() })
                    .collect(),
                vec![2.5; n],
            ];
            for (case, s) in cases.iter().enumerate() {
                for k in [0, 1, n / 3, n.saturating_sub(1), n] {
                    top_k(s, k, &mut out, &mut scratch);
                    let want = top_k_reference(s, k);
                    assert!(out.windows(2).all(|w| w[0] < w[1]), "ascending");
                    let scores = |v: &[u32]| {
                        let mut x: Vec<f32> = v.iter().map(|&i| s[i as usize]).collect();
                        x.sort_by(|a, b| b.total_cmp(a));
                        x
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
