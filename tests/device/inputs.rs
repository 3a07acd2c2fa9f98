//! Input sparsity (`teal`, `wina`) on a device against the reference device: decode steps,
//! and TEAL's masked batches (calibration's allocation search).
use super::*;

/// Input sparsity (`teal`, `wina`, with a head rule too) on the device against the same policy
/// on the reference device, on gated and ungated, grouped-query, biased and post-norm fixtures,
/// thresholds calibrated on the fixture. Tolerance: an input whose score lies within rounding
/// of its threshold may be kept on one side and dropped on the other, so 0.1 + 0.01 |ref|
/// (measured: printed). Teal alone is checked as masked batches too. Returns the worst error.
/// `same_bits`: a session that does not measure gives the bits of one that does (a device
/// whose sums do not depend on its threads' timing).
pub fn input_sparsity_conforms<D: Device>(dev: &D, same_bits: bool) -> f32 {
    use dejavu::sparsity::predictors_file::Predictors;
    let mut worst = 0f32;
    for (name, spec) in [
        ("llama-silu", "teal:0.4:always"),
        ("qwen2", "wina:0.5:always"),
        ("opt-relu", "teal:0.3:always+attn-norm:0.5"),
        ("opt-relu", "teal:0.3:always"),
        ("opt-postln-proj", "wina:0.3:always"),
    ] {
        let eng = load(name);
        let c = &eng.model.config;
        // Calibration tokens other than the decoded ones: a threshold equal to a decoded
        // input's value would make rounding decide that input.
        let vocab = c.vocab_size as u32;
        let tokens: Vec<u32> = (0..64u32).map(|i| (i * 37 + 11) % vocab).collect();
        let stats = dejavu::tune::thresholds::input_stats(&eng, &eng, &tokens, 32).unwrap();
        let preds = Predictors::inputs_only(stats);
        let pol = eng.policy(spec, Some(&preds)).unwrap();
        let run =
            |d: &dyn Fn(&[u32]) -> Vec<f32>| TOKENS.iter().map(|&t| d(&[t])).collect::<Vec<_>>();
        // A session that measures writes the kept inputs (`sparsify`) before each product; one
        // that does not hands the products the thresholds (`axpys` with a mask).
        let on = |dev: &D, measure: bool| {
            let dm = eng.device_model(dev, &[&pol]).unwrap();
            let plan = DevicePlan::policy(dev, c, &pol).unwrap();
            let mut s = DeviceSession::new(dev, &dm, plan, 16).unwrap();
            s.measure(measure);
            let sess = std::cell::RefCell::new(s);
            run(&|t| sess.borrow_mut().forward(t).unwrap().to_vec())
        };
        let (got, masked) = (on(dev, true), on(dev, false));
        if same_bits {
            assert!(
                got == masked,
                "{name} {spec}: thresholds in the products change the bits"
            );
        }
        let r = CpuDevice::reference();
        let rm = eng.device_model(&r, &[&pol]).unwrap();
        let rplan = DevicePlan::policy(&r, c, &pol).unwrap();
        let mut rs = DeviceSession::new(&r, &rm, rplan, 16).unwrap();
        let mut check = |what: &str, i: usize, g: &[f32], want: &[f32]| {
            for (j, (a, b)) in g.iter().zip(want).enumerate() {
                let err = (a - b).abs();
                assert!(
                    err <= 0.1 + 0.01 * b.abs(),
                    "{name} {spec} {what} {i} logit {j}: device {a}, reference {b}"
                );
                worst = worst.max(err);
            }
        };
        let mut steps = Vec::new();
        for (i, (g, &t)) in got.iter().zip(&TOKENS).enumerate() {
            let want = rs.forward(&[t]).unwrap();
            check("step", i, g, want);
            check("step, thresholds in the products", i, &masked[i], want);
            steps.push(want.to_vec());
        }
        // A masked batch (calibration's allocation search; TEAL without a head rule, whose
        // batches run every head) gives each row the reference's decode step; between decode
        // steps (a recorded step before it, replayed after), so are the steps.
        if spec.starts_with("teal") && !spec.contains('+') {
            let dm = eng.device_model(dev, &[&pol]).unwrap();
            let plan = DevicePlan::policy(dev, c, &pol).unwrap();
            let mut s = DeviceSession::new(dev, &dm, plan, 16).unwrap();
            s.mask_batches(true).unwrap();
            let n = TOKENS.len();
            check(
                "step before a masked batch",
                0,
                s.forward(&TOKENS[..1]).unwrap(),
                &steps[0],
            );
            let rows = s.run(&TOKENS[1..n - 1], Logits::Range(0, n - 2)).unwrap();
            for (i, (g, want)) in rows.chunks(c.vocab_size).zip(&steps[1..]).enumerate() {
                check("masked batch row", i + 1, g, want);
            }
            let last = s.forward(&TOKENS[n - 1..]).unwrap();
            check("step after a masked batch", n - 1, last, &steps[n - 1]);
        }
    }
    worst
}

#[test]
fn input_sparsity_on_every_cpu_tier_conforms_to_the_reference() {
    use dejavu_backend_cpu::isa::Isa;
    for isa in Isa::supported() {
        let worst = input_sparsity_conforms(&CpuDevice::with_isa(isa, 2).unwrap(), true);
        eprintln!("{isa}: teal and wina, worst |logit error| {worst:.2e}");
    }
}
