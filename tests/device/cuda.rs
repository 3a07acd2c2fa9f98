//! The conformance suite on the GPU (see `tests/device.rs`), built with `--features cuda`;
//! each test is skipped, with the reason printed, where there is no GPU.
use super::*;
use dejavu_backend_cuda::CudaDevice;

fn gpu() -> Option<CudaDevice> {
    CudaDevice::new(0)
        .map_err(|e| eprintln!("skipped: no usable GPU ({e})"))
        .ok()
}

#[test]
fn fixed_plans_on_the_gpu_match_the_reference() {
    if let Some(g) = gpu() {
        check_fixtures(&g);
    }
}

#[test]
fn quantized_files_on_the_gpu_match_the_reference() {
    if let Some(g) = gpu() {
        check_quantized(&g);
    }
}

#[test]
fn smollm2_on_the_gpu_matches_the_reference() {
    if let Some(g) = gpu() {
        check_smollm2(&g);
    }
}

/// Deja Vu policies, with full and with lazy K/V, with and without lookahead, on the GPU run
/// the plans they select (see `policy_runs_its_selection`).
#[test]
fn a_policy_on_the_gpu_runs_the_plan_it_selects() {
    let Some(g) = gpu() else { return };
    // Without and with lookahead (a second lane), with full and with lazy K/V.
    policy_runs_its_selection(&g, "dejavu:0.1+dejavu-attn:0.5");
    policy_runs_its_selection(&g, "paper");
    let missed = policy_runs_its_selection(&g, "dejavu:0.1+dejavu-attn:0.5+lookahead+lazy-kv");
    eprintln!(
        "{}: Deja Vu policies (full and lazy K/V, lookahead) run their own selections, {} \
         steps each; {missed} selected heads recomputed missed positions",
        g.name(),
        TOKENS.len() + 2
    );
}

/// `gate-first`, `up-first`, `oracle`, `relu-exact` and `attn-norm` on the GPU run the plans
/// they select (see `rules_that_select_from_activations_run`).
#[test]
fn rules_that_select_from_activations_run_on_the_gpu() {
    let Some(g) = gpu() else { return };
    rules_that_select_from_activations_run(&g);
    eprintln!("{}: gate-first, up-first, oracle, relu-exact and attn-norm run their own selections on 5 fixtures", g.name());
}

/// Input sparsity on the GPU (see `input_sparsity_conforms`): thresholds compared on the
/// device, inside the recorded step (by `sparsify`, and inside the products).
#[test]
fn input_sparsity_on_the_gpu_conforms_to_the_reference() {
    let Some(g) = gpu() else { return };
    let worst = inputs::input_sparsity_conforms(&g, false);
    eprintln!(
        "{}: teal and wina on 4 fixtures, worst |logit error| {worst:.2e}",
        g.name()
    );
}

/// Speculation's verification on the GPU (see `verification_is_the_dense_steps`): each row
/// within the suite's tolerance of the GPU's own dense decode step.
#[test]
fn verification_on_the_gpu_matches_its_dense_steps() {
    let Some(g) = gpu() else { return };
    let worst = verification_is_the_dense_steps(&g, false);
    eprintln!(
        "{}: verified rows against dense steps on 4 fixtures, worst |logit error| {worst:.2e}",
        g.name()
    );
}

/// Prompts in batches on the GPU (see `prompts_in_batches_match_the_reference`).
#[test]
fn prompts_on_the_gpu_run_in_batches() {
    let Some(g) = gpu() else { return };
    let worst = prompts_in_batches_match_the_reference(&g);
    eprintln!(
        "{}: prompts in batches match the reference's batches, worst |logit error| \
         {worst:.2e}",
        g.name()
    );
}

/// The contextual output head on the GPU (see `contextual_head_matches_the_reference`).
#[test]
fn the_contextual_head_on_the_gpu_matches_the_reference() {
    let Some(g) = gpu() else { return };
    contextual_head_matches_the_reference(&g);
    eprintln!("{}: the contextual head matches the reference", g.name());
}

/// The same Deja Vu policy on the host reference device and on the GPU picks the same sets
/// (synthetic:opt-125m, random predictors): the share of each selected set found by both,
/// printed; at least 99% (the scores differ only by summation order, so only near-ties
/// may go either way).
#[test]
fn a_policy_picks_the_same_sets_on_the_gpu() {
    let Some(g) = gpu() else { return };
    let host = CpuDevice::reference();
    let opts = EngineOptions {
        keep_file_layout: true,
        n_ctx: Some(16),
        ..Default::default()
    };
    let eng = Engine::load("synthetic:opt-125m", &opts).unwrap();
    let preds = eng.predictors(None).unwrap();
    let policy = eng
        .policy("dejavu:0.1+dejavu-attn:0.5", preds.as_ref())
        .unwrap();
    let layout = eng.sparse_layout().unwrap();
    let (hm, gm) = (
        DeviceModel::upload(&host, &eng.model, Some(layout)).unwrap(),
        DeviceModel::upload(&g, &eng.model, Some(layout)).unwrap(),
    );
    let c = &eng.model.config;
    let mut hs = DeviceSession::new(
        &host,
        &hm,
        DevicePlan::policy(&host, c, &policy).unwrap(),
        16,
    )
    .unwrap();
    let mut gs =
        DeviceSession::new(&g, &gm, DevicePlan::policy(&g, c, &policy).unwrap(), 16).unwrap();
    let (mut found, mut total) = (0usize, 0usize);
    for &t in &TOKENS[..4] {
        hs.forward(&[t]).unwrap();
        gs.forward(&[t]).unwrap();
        for ((hm, hh), (gm, gh)) in hs
            .selections()
            .unwrap()
            .into_iter()
            .zip(gs.selections().unwrap())
        {
            for (a, b) in [(hm, gm), (hh, gh)] {
                if let (Some(a), Some(b)) = (a, b) {
                    total += a.len();
                    found += a.iter().filter(|i| b.binary_search(i).is_ok()).count();
                }
            }
        }
    }
    let share = found as f64 / total as f64;
    eprintln!(
        "{}: the policy's sets agree with the host reference's on {found}/{total} units ({:.4})",
        g.name(),
        share
    );
    assert!(share >= 0.99, "agreement {share}");
}

/// Two processes on the one GPU as NCCL ranks 0 and 1 give the single GPU's logits, over a
/// prompt batch and decode steps, with the steps recorded as CUDA graphs (NCCL calls
/// included) and run eagerly. NCCL refuses two ranks on one GPU of one host, so each process
/// gets its own `NCCL_HOSTID` and NCCL's socket transport over loopback: a test setup.
/// Tolerance: `assert_close`'s (the ranks' partial sums are added in another order).
#[test]
fn two_processes_on_one_gpu_give_the_single_gpus_logits() {
    if let Ok(rank) = std::env::var("DEJAVU_TP_CHILD") {
        return tp_child(rank.parse().unwrap());
    }
    let Some(g) = gpu() else { return };
    if let Err(e) = dejavu_backend_cuda::nccl_id() {
        return eprintln!("skipped: {e}");
    }
    let runs = [
        ("llama-silu", "dense", true),
        ("llama-silu", "dense", false),
        ("opt-relu", "dense", true),
        ("opt-relu", "dense", false),
        ("opt-relu", "uneven", true),
    ];
    for (name, which, graphs) in runs {
        let eng = load(name);
        let layout = eng.sparse_layout().unwrap();
        let dm = DeviceModel::upload(&g, &eng.model, Some(layout)).unwrap();
        let plan = DevicePlan::fixed(&g, &eng.model.config, &tp_plan(&eng, which), which);
        let mut sess = DeviceSession::new(&g, &dm, plan.unwrap(), 64).unwrap();
        let want = tp_steps(&mut sess);
        let got = tp_world(name, which, graphs);
        let mut worst = 0f32;
        for (rank, logits) in got.iter().enumerate() {
            for (i, (d, w)) in logits.chunks(want[0].len()).zip(&want).enumerate() {
                let what = format!("{name} {which} rank {rank} step {i} graphs {graphs}");
                worst = worst.max(assert_close(&what, d, w));
            }
        }
        eprintln!(
            "{name}, {which} plan: 2 processes on one GPU (graphs {graphs}): logits equal the \
             single GPU's, worst |error| {worst:.2e}"
        );
    }
}

/// The plan `which` of [`tp_world`]: dense, or `common::uneven_plan` (some rank holds none
/// of a layer's heads).
fn tp_plan(eng: &Engine, which: &str) -> SparsePlan {
    match which {
        "dense" => SparsePlan::dense(&eng.model.config),
        _ => common::uneven_plan(eng),
    }
}

/// The prompt's logits (one batch of 5), then 4 decode steps'.
fn tp_steps(d: &mut dyn dejavu::exec::Decoder) -> Vec<Vec<f32>> {
    let mut out = vec![d.decode(&TOKENS[..5]).unwrap().to_vec()];
    for &t in &TOKENS[5..] {
        out.push(d.decode(&[t]).unwrap().to_vec());
    }
    out
}

/// Run the world of 2 processes on fixture `name` under plan `which`; each rank's logits,
/// all steps.
fn tp_world(name: &str, which: &str, graphs: bool) -> Vec<Vec<f32>> {
    let id = dejavu_backend_cuda::nccl_id().unwrap();
    let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
    let dir = std::env::temp_dir().join(format!("dejavu-tp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..2)
        .map(|rank| {
            let mut c = std::process::Command::new(&exe);
            c.args([
                "cuda::two_processes_on_one_gpu_give_the_single_gpus_logits",
                "--exact",
                "--nocapture",
            ])
            .env("DEJAVU_TP_CHILD", rank.to_string())
            .env("DEJAVU_TP_ID", &hex)
            .env("DEJAVU_TP_MODEL", name)
            .env("DEJAVU_TP_PLAN", which)
            .env("DEJAVU_TP_OUT", dir.join(format!("rank{rank}")))
            .env("NCCL_HOSTID", format!("dejavu-tp-test-{rank}"))
            .env("NCCL_NVLS_ENABLE", "0")
            .env("NCCL_SOCKET_IFNAME", "lo")
            .env("NCCL_IB_DISABLE", "1");
            if !graphs {
                c.env("DEJAVU_TP_GRAPHS", "0");
            }
            c.stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outs: Vec<_> = children
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    for (rank, o) in outs.iter().enumerate() {
        let err = String::from_utf8_lossy(&o.stderr);
        for line in err.lines().filter(|l| l.starts_with("rank ")) {
            eprintln!("{name}: {line}");
        }
        assert!(o.status.success(), "rank {rank}: {}\n{err}", o.status);
    }
    (0..2)
        .map(|rank| {
            let bytes = std::fs::read(dir.join(format!("rank{rank}"))).unwrap();
            (bytes.chunks_exact(4))
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect()
        })
        .collect()
}

/// A rank of [`tp_world`]: its shard on the GPU, the steps, its logits to a file; then the
/// mean time of 32 more decode steps.
fn tp_child(rank: usize) {
    use dejavu::exec::parallel::Shard;
    let var = |k: &str| std::env::var(k).unwrap();
    let hex = var("DEJAVU_TP_ID");
    let mut id = [0u8; dejavu_backend_cuda::ID_BYTES];
    for (i, b) in id.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap();
    }
    let dev = CudaDevice::in_world(0, rank, 2, &id).unwrap();
    let eng = load(&var("DEJAVU_TP_MODEL"));
    let shard = Shard::new(rank, 2).unwrap();
    let layout = eng.sparse_layout().unwrap();
    let dm = DeviceModel::upload_shard(&dev, &eng.model, Some(layout), shard).unwrap();
    let sparse = tp_plan(&eng, &var("DEJAVU_TP_PLAN"));
    let plan = DevicePlan::fixed_shard(&dev, &eng.model.config, shard, &sparse, "p").unwrap();
    let mut sess = DeviceSession::new(&dev, &dm, plan, 64).unwrap();
    let logits: Vec<u8> = (tp_steps(&mut sess).concat().iter())
        .flat_map(|x| x.to_le_bytes())
        .collect();
    std::fs::write(var("DEJAVU_TP_OUT"), logits).unwrap();
    let t0 = std::time::Instant::now();
    for i in 0..32 {
        sess.forward(&[TOKENS[i % TOKENS.len()]]).unwrap();
    }
    let ms = t0.elapsed().as_secs_f64() * 1e3 / 32.0;
    eprintln!("rank {rank}: {ms:.3} ms per decode step (socket transport, one GPU)");
}

/// Calibration on the GPU (see `calibration_conforms`).
#[test]
fn calibration_on_the_gpu_conforms_to_the_reference() {
    let Some(g) = gpu() else { return };
    let (err, density, recall) = calibration_conforms(&g);
    eprintln!(
        "{}: calibration's activations within {err:.1e} of the largest; trained on the GPU's \
         passes, densities within {density:.4} and recalls within {recall:.4} of the reference's",
        g.name()
    );
}

/// Steps of several sequences on the GPU (see `batched_steps_are_each_sequences_own`): each
/// row within the suite's tolerance of the sequence's own decode step on the GPU (the batch's
/// products sum in another order than a one-row step's).
#[test]
fn batched_steps_on_the_gpu_match_each_sequences_own() {
    let Some(mut g) = gpu() else { return };
    // Row by row with `matvec_rows`, then in one call with the tensor cores' products, then
    // that call's positions split into spans of 4 (`ATT_SPAN`; merged after); the last two
    // again recorded (`SEQ_GRAPHS`: a graph per leader and row count, replayed over other
    // rows).
    for (one_call, span, record) in CONFIGS {
        g.set_attend_rows(one_call);
        g.set_mma(one_call);
        g.set_att_span(span);
        g.set_seq_graphs(record);
        let worst = batching::batched_steps_are_each_sequences_own(&g, false, false);
        eprintln!(
            "{}: steps of 1 to 4 sequences on 13 fixtures (attention {}), worst |logit error| \
             {worst:.2e}",
            g.name(),
            attention(one_call, span, record)
        );
    }
}

/// `--deterministic` on the GPU (`CudaDevice::set_deterministic`): on every fixture (bf16
/// weights: the tensor cores' products) and on synthetic OPT-125M (f16 weights), steps
/// of several sequences are bit for bit each sequence's own steps, with attention spans of 4
/// asked for (deterministic attention takes none), and a position's logits are bit for bit the
/// same however its prompt was split.
#[test]
fn deterministic_gpu_steps_and_prompts_are_batch_invariant() {
    let Some(mut g) = gpu() else { return };
    g.set_deterministic(true);
    g.set_att_span(4);
    assert!(g.batch_invariant());
    batching::batched_steps_are_each_sequences_own(&g, true, false);
    for name in FIXTURES {
        batching::prompt_splits_give_one_logits(&g, &load(name), name);
    }
    {
        let opts = EngineOptions {
            keep_file_layout: true,
            ..Default::default()
        };
        let (name, eng) = (
            "synthetic f16 opt-125m",
            Engine::load("synthetic:opt-125m", &opts),
        );
        batching::prompt_splits_give_one_logits(&g, &eng.unwrap(), name);
    }
}

/// (a)-(f) of tests/determinism.rs on the GPU under `--deterministic`: `dejavu serve --backend
/// cuda --deterministic` replies byte for byte as `dejavu generate` with the same flags, one
/// by one, 16 at once with `--parallel 8`, on a warm prompt cache, with `cache_prompt` off,
/// greedy and sampled; on the llama-silu fixture (bf16 rows) and the qwen2 one converted to
/// f16 (a GGUF made by `dejavu quantize`). Dense only (the GPU's `--deterministic` refuses
/// sparse policies).
#[test]
fn deterministic_serving_on_the_gpu_replies_as_generate() {
    if gpu().is_none() {
        return;
    }
    let on = ["--backend", "cuda", "--deterministic", "true"];
    let silu = root().join("tests/fixtures/hf/llama-silu");
    common::same_reply::replies_equal_generate(&silu, "llama-silu", &on, &["dense"]);
    let dir = tempfile::tempdir().unwrap();
    let f16 = dir.path().join("qwen2-f16.gguf");
    common::stdout_of(
        std::process::Command::new(env!("CARGO_BIN_EXE_dejavu"))
            .args(["quantize", "--type", "f16", "-o"])
            .arg(&f16)
            .arg(root().join("tests/fixtures/hf/qwen2")),
    );
    common::same_reply::replies_equal_generate(&f16, "qwen2 f16", &on, &["dense"]);
}

/// Sequences forked from another's prompt on the GPU (see
/// `forked_sequences_continue_as_their_source`), within the suite's tolerance.
#[test]
fn forked_sequences_on_the_gpu_continue_as_their_source() {
    let Some(g) = gpu() else { return };
    let worst = batching::forked_sequences_continue_as_their_source(&g, false);
    eprintln!(
        "{}: forked sequences, worst |logit error| {worst:.2e}",
        g.name()
    );
}

/// Steps of several sequences under sparse plans on the GPU: a fixed random plan on every
/// fixture (each row within the suite's tolerance of its sequence's own sparse step on the
/// GPU), and a Deja Vu policy whose rows attend over their own predicted heads and run the MLP
/// over the union of the rows' neurons (each row within the tolerance of the CPU reference's
/// step under that plan).
#[test]
fn sparse_batched_steps_on_the_gpu_match_their_plans() {
    let Some(mut g) = gpu() else { return };
    for (one_call, span, record) in CONFIGS {
        g.set_attend_rows(one_call);
        g.set_mma(one_call);
        g.set_att_span(span);
        g.set_seq_graphs(record);
        let fixed = batching::batched_steps_are_each_sequences_own(&g, false, true);
        let predicted =
            batching::predicted_batched_steps_run_each_rows_heads_and_the_union(&g, false);
        eprintln!(
            "{}: sparse steps of 1 to 4 sequences (attention {}), worst |logit error| \
             {fixed:.2e} (fixed plans, 13 fixtures), {predicted:.2e} (dejavu:0.1+dejavu-attn:0.5 \
             against the reference)",
            g.name(),
            attention(one_call, span, record)
        );
    }
}

/// The batched tests' configurations: attention in one call, its positions' span (0: none),
/// the steps recorded.
const CONFIGS: [(bool, usize, bool); 5] = [
    (false, 0, false),
    (true, 0, false),
    (true, 4, false),
    (true, 0, true),
    (true, 4, true),
];

/// How a batched test's configuration ran attention.
fn attention(one_call: bool, span: usize, record: bool) -> String {
    let how = match (one_call, span) {
        (false, _) => "row by row",
        (true, 0) => "in one call, products on the tensor cores",
        (true, _) => "in one call, positions in spans, products on the tensor cores",
    };
    match record {
        true => format!("{how}, rows set for the step, dense steps recorded"),
        false => how.to_string(),
    }
}

/// `dejavu serve --backend cuda` as a process under load, its sequences' steps batched
/// (`common::load`): 32 clients x 8 requests on the llama-silu fixture, every reply whole and
/// `dejavu generate --backend cuda`'s, or parting from it only at a near-tie (top two
/// log-probabilities within 0.02: a batch's tensor-core products round otherwise than one
/// row's matrix-vector products, within the suite's logit tolerance); host memory flat;
/// SIGTERM under load clean.
#[test]
fn serving_on_the_gpu_under_load_matches_generate() {
    if gpu().is_none() {
        return;
    }
    let model = root().join("tests/fixtures/hf/llama-silu");
    common::load::on_fixture(&model, "cuda", 0.02);
}

/// Faults that reach the batch thread, on the GPU (`common::faults`): a client that hangs up
/// mid-stream beside another reply (cancelled; the other ends whole), a prompt past the context
/// (a 400, the batch goes on), and SIGTERM with no grace under two streams (each ends with an
/// error chunk and `[DONE]`, exit 0). The HTTP layer's faults are the CPU's (tests/serve.rs).
#[test]
fn faults_on_the_gpu_are_bounded_and_the_server_keeps_serving() {
    if gpu().is_none() {
        return;
    }
    let model = root().join("tests/fixtures/hf/llama-silu");
    common::faults::on_fixture(&model, "cuda", false);
}
