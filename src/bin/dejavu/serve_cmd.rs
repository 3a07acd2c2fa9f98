//! `dejavu serve`: the OpenAI-compatible server (`dejavu::serve`) over `--parallel` slots. On
//! one device the slots' sequences share one engine, with every thread, and their decode
//! steps run together (continuous batching, `serve::batch`); tensor-parallel worlds keep an
//! engine per slot.
use super::{ModelArgs, SparsityArgs};
use crate::backend_choice::{with_decoder, with_sequences, BackendKind, Placement};
use anyhow::{bail, Context, Result};
use clap::Args;
use dejavu::exec::Engine;
use dejavu::serve::{self, Limits, ServeOptions, Slot};
use dejavu::sparsity::policy::Policy;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Address to bind (loopback by default; any other needs an API key).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Replies generated at once, each with its own KV cache; their decode steps run as one
    /// batch (one read of the weights for all of them).
    #[arg(long, default_value_t = 1)]
    parallel: usize,
    /// Context window of each slot in tokens (default: min(model's, 4096)).
    #[arg(long)]
    ctx: Option<usize>,
    /// Require `Authorization: Bearer KEY` on /v1 routes (or set DEJAVU_API_KEY).
    #[arg(long, env = "DEJAVU_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Requests that may wait for a free slot (more get a 503 at once).
    #[arg(long, default_value_t = 64)]
    queue: usize,
    /// Seconds a request may wait for a slot (then a 503).
    #[arg(long, default_value_t = 60)]
    queue_timeout: u64,
    /// Open connections at most (more are closed at once).
    #[arg(long, default_value_t = 256)]
    max_connections: usize,
    /// Seconds a client has to send a request's headers, and again its body.
    #[arg(long, default_value_t = 10)]
    read_timeout: u64,
    /// Seconds a reply may wait on a client that reads nothing before it is dropped.
    #[arg(long, default_value_t = 30)]
    stall_timeout: u64,
    /// On SIGTERM, seconds in-flight replies get to finish before they end with an error.
    #[arg(long, default_value_t = 30)]
    shutdown_grace: u64,
    /// Recompute every prompt whole: no reuse of the prefix a slot's KV cache holds.
    #[arg(long)]
    no_prefix_reuse: bool,
    /// Another name requests may give the model (repeatable; the first is the name listed).
    /// The model is also served under its file name, its stem and the `--model` argument.
    #[arg(long)]
    alias: Vec<String>,
    /// `max_tokens` of a request that names none.
    #[arg(long, default_value_t = 512)]
    max_tokens: usize,
    /// KV positions the batched sequences may hold together (`--parallel` > 1 on the CPU), at
    /// least `--ctx`: a sequence holds what it has written since its cache was last given
    /// back to the system. Past the pool, idle sequences' caches (their cached prompt
    /// prefixes) go back first; a prompt that still does not fit is a 503, and a reply that
    /// runs out of room ends with `length`. Default: each sequence its own `--ctx`.
    #[arg(long)]
    kv_pool: Option<usize>,
    #[command(flatten)]
    sparsity: SparsityArgs,
}

pub fn cmd_serve(a: ServeArgs) -> Result<()> {
    let addr: SocketAddr = format!("{}:{}", a.host, a.port)
        .parse()
        .or_else(|_| {
            use std::net::ToSocketAddrs;
            (a.host.as_str(), a.port)
                .to_socket_addrs()?
                .next()
                .context("no address")
        })
        .with_context(|| format!("bad --host/--port `{}:{}`", a.host, a.port))?;
    let api_key = a.api_key.clone().filter(|k| !k.is_empty());
    if let Some(k) = &api_key {
        serve::check_api_key(k).map_err(anyhow::Error::msg)?;
    }
    if !serve::is_loopback(&addr) && api_key.is_none() {
        bail!("binding {addr} (not loopback) needs --api-key or DEJAVU_API_KEY");
    }
    if a.parallel == 0 {
        bail!("--parallel must be at least 1");
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut model = a.model.clone();
    let launched_as = (model.model.as_ref()).map_or(dejavu::fetch::DEFAULT_MODEL.into(), |m| {
        m.to_string_lossy().into_owned()
    });
    let threads = model.threads.unwrap_or(cores);
    let batched = a.parallel > 1 && model.tensor_parallel <= 1;
    if !batched {
        model.threads = Some((threads / a.parallel).max(1));
    }
    let mut slots: Vec<Slot> = Vec::new();
    let mut opts = None;
    // Batched: one engine, its sequences stepped together on one thread; else (one slot, or
    // tensor-parallel worlds) an engine per slot.
    let copies = if batched { 1 } else { a.parallel };
    for i in 0..copies {
        let engine = model
            .load(a.ctx)
            .with_context(|| format!("loading slot {i}"))?;
        let policy = a.sparsity.policy(&engine)?;
        if opts.is_none() {
            opts = Some(options(&a, &launched_as, api_key.clone(), &engine, &policy));
        }
        let backend = model.placement();
        if let Some(pool) = a.kv_pool {
            if !batched || backend.backend != BackendKind::Cpu {
                bail!("--kv-pool bounds the KV memory of batched sequences on the CPU (--parallel > 1, no --backend cuda, no --tensor-parallel)");
            }
            if pool < engine.n_ctx {
                bail!(
                    "--kv-pool {pool} is below the context ({}): one full context must fit",
                    engine.n_ctx
                );
            }
        }
        if batched {
            slots = batched_slots(engine, policy, backend, a.parallel, a.kv_pool)?;
            break;
        }
        slots.push(Box::new(move |jobs, metrics| {
            let run = with_decoder(&engine, backend, &policy, |dec| {
                serve::worker::run_slot(&engine, dec, &jobs, &metrics);
                Ok(())
            });
            if let Err(e) = run {
                eprintln!("error: slot {i}: {e:#}");
            }
        }));
    }
    let opts = opts.context("no slots")?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding {addr}"))?;
        eprintln!(
            "serving {} on http://{} ({} slot(s), sparsity {}); Ctrl-C or SIGTERM stops",
            opts.model_id,
            listener.local_addr()?,
            a.parallel,
            opts.sparsity
        );
        serve::serve(listener, opts, slots, shutdown_signal()).await?;
        eprintln!("stopped");
        Ok(())
    })
}

/// The server's options, from the arguments and the first engine.
fn options(
    a: &ServeArgs,
    launched_as: &str,
    api_key: Option<String>,
    engine: &Engine,
    policy: &Policy,
) -> ServeOptions {
    let names = serve::model_names(&a.alias, launched_as, &engine.model.path);
    ServeOptions {
        model_id: names[0].clone(),
        model_names: names,
        api_key,
        queue: a.queue,
        queue_timeout: Duration::from_secs(a.queue_timeout),
        max_body: 1 << 20,
        default_max_tokens: a.max_tokens,
        vocab: engine.model.config.vocab_size,
        tokenizer: engine.tokenizer.clone(),
        sparsity: policy.name.clone(),
        mlp_density: policy.mean_mlp_density(engine.model.config.n_ff),
        reuse_prefix: !a.no_prefix_reuse,
        limits: Limits {
            max_connections: a.max_connections,
            read_timeout: Duration::from_secs(a.read_timeout.max(1)),
            stall_timeout: Duration::from_secs(a.stall_timeout.max(1)),
            shutdown_grace: Duration::from_secs(a.shutdown_grace),
        },
    }
}

/// `n` slots over one engine (continuous batching): the batch thread owns the `n` sequences
/// on the device and steps them together; each slot's decoder hands it its tokens.
fn batched_slots(
    engine: Engine,
    policy: Policy,
    at: Placement,
    n: usize,
    pool: Option<usize>,
) -> Result<Vec<Slot>> {
    let engine = Arc::new(engine);
    let (decs, rx) = serve::batch::decoders(n, engine.n_ctx);
    let (eng, (tx, ready)) = (engine.clone(), std::sync::mpsc::channel());
    std::thread::Builder::new()
        .name("batch".into())
        .spawn(move || {
            let ran = with_sequences(&eng, at, &policy, n, |seqs| {
                let _ = tx.send(Ok(()));
                serve::batch::run(seqs, rx, serve::batch::PROMPT_CHUNK, pool);
                Ok(())
            });
            if let Err(e) = ran {
                let _ = tx.send(Err(format!("{e:#}")));
            }
        })?;
    // The sequences are open (or why not) before the server starts.
    match ready.recv() {
        Ok(Ok(())) => {}
        Ok(Err(e)) => bail!("opening {n} sequences: {e}"),
        Err(_) => bail!("opening {n} sequences: the batch thread ended"),
    }
    Ok(decs
        .into_iter()
        .map(|mut dec| {
            let engine = engine.clone();
            Box::new(
                move |jobs: Arc<serve::worker::Jobs>, metrics: Arc<serve::Metrics>| {
                    serve::worker::run_slot(&engine, &mut dec, &jobs, &metrics)
                },
            ) as Slot
        })
        .collect())
}

/// Ctrl-C, or SIGTERM where there are signals.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
