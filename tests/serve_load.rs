//! The load test of `dejavu serve` on the CPU: SmolLM2 served as a process (four sequences in
//! one batch), 32 concurrent clients x 8 requests each (chat and completions, streamed and
//! whole, greedy). Every reply must arrive whole and equal, byte for byte, what `dejavu
//! generate` prints with the same settings; the server's anonymous memory must stay flat over
//! the run. Then SIGTERM with streams in flight: each ends with `[DONE]`, and the process
//! exits 0 (see `common::load`; `tests/device/cuda.rs` runs the same on the GPU).
//!
//! It prints the p50/p99 latency and the aggregate tok/s: bench figures, not asserted.
mod common;

use common::load::Load;

#[test]
fn thirty_two_clients_get_every_reply_whole_and_equal_to_generate() {
    let model = dejavu::fetch::fetch(dejavu::fetch::DEFAULT_MODEL).unwrap();
    // Prefix reuse off: a prompt computed on cached keys and values of another batch split is
    // the same math in another rounding order, and greedy replies could then part from
    // `generate`'s at near-ties (tests/serve.rs checks reuse itself).
    let serve = [
        "--parallel",
        "4",
        "-t",
        "2",
        "--ctx",
        "512",
        "--no-prefix-reuse",
    ];
    Load {
        model: &model,
        serve: &serve,
        generate: &["-t", "1", "--ctx", "512"],
        clients: 32,
        rounds: 8,
        max_tokens: 16,
        near_tie: None,
    }
    .run();
}

/// The GPU's check (`common::load::check_reply` with a near-tie bound): equal replies pass;
/// a reply that parts from `generate`'s passes only with a near-tie at or just before the
/// first differing byte; without a bound any difference fails.
#[test]
fn a_reply_may_part_from_generate_only_at_a_near_tie() {
    use common::load::check_reply;
    let tied = vec![-0.70, -0.69];
    let clear = vec![-0.01, -5.0];
    let p = |lens: &[usize], tops: &[&Vec<f32>]| -> Vec<(usize, Vec<f32>)> {
        lens.iter()
            .zip(tops)
            .map(|(&l, t)| (l, (*t).clone()))
            .collect()
    };
    // " a" " cat" " sat" against " a dog sat": the parting token " cat" (bytes 2..6).
    let at_cat = |t: &Vec<f32>| p(&[2, 4, 4], &[&clear, t, &clear]);
    assert!(check_reply(None, " a cat sat", &at_cat(&clear), " a cat sat").is_ok());
    assert!(check_reply(None, " a cat sat", &at_cat(&tied), " a dog sat").is_err());
    assert!(check_reply(Some(0.02), " a cat sat", &at_cat(&tied), " a dog sat").is_ok());
    assert!(check_reply(Some(0.02), " a cat sat", &at_cat(&clear), " a dog sat").is_err());
    // The near-tie a token before the differing byte (" th" + "ink" against " the" + "re").
    let early = p(&[3, 3], &[&tied, &clear]);
    assert!(check_reply(Some(0.02), " think", &early, " there").is_ok());
    // Too far before it: tokens 0 (tied) and 1..=3 clear, the bytes first differ in token 3.
    let far = p(&[2, 2, 2, 2], &[&tied, &clear, &clear, &clear]);
    assert!(check_reply(Some(0.02), " a b c d", &far, " a b c e").is_err());
    // A served text that is a prefix of generate's: the last token holds the parting.
    let short = p(&[2, 4], &[&clear, &tied]);
    assert!(check_reply(Some(0.02), " a the", &short, " a there").is_ok());
    // Tokens that do not cover the text fail.
    assert!(check_reply(Some(0.02), " a cat", &p(&[2], &[&tied]), " a dog").is_err());
}

/// The GPU's load test (tests/device/cuda.rs) on the CPU, so that CI runs its machinery: the
/// llama-silu fixture, every reply `max_tokens` long past end-of-generation tokens, with its
/// log-probabilities (each token's two alternatives, the tokens' bytes the text's), on every
/// kind of request under load. A near-tie bound of 0: only an exact tie may part a reply
/// from `generate`'s (on the CPU none does: a sequence's logits do not depend on its batch).
#[test]
fn the_gpu_load_test_runs_on_the_cpu() {
    let model =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/llama-silu");
    common::load::on_fixture(&model, "cpu", 0.0);
}

/// The GPU's fault test (tests/device/cuda.rs) on the CPU: a hang-up beside a reply in flight,
/// a prompt past the context, and SIGTERM with no grace, on two sequences stepped as one batch
/// (see `common::faults`); the reply beside the hang-up equal to the reply alone.
#[test]
fn the_gpu_fault_test_runs_on_the_cpu() {
    let model =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/llama-silu");
    common::faults::on_fixture(&model, "cpu", true);
}
