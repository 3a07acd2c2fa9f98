//! A tensor-parallel world in one process: a thread per rank, each with its own device, its
//! [`Shard`] of the model and its session, driven in lock step by a [`ParallelDecoder`] (every
//! rank runs every step, so every rank reaches the same collectives in the same order). The
//! logits are the world's (each rank holds them after the all-gather); rank 0's are returned.
use super::Shard;
use crate::engine::device::{DeviceModel, DevicePlan, DeviceSession, Selections};
use crate::engine::weights::Model;
use crate::sparsity::layout::SparseLayout;
use crate::text::generate::Decoder;
use crate::{Error, Result};
use dejavu_backend_api::Device;
use std::sync::mpsc::{channel, Receiver, Sender};

/// What the rank threads are asked to do.
enum Cmd {
    Forward(Vec<u32>),
    Truncate(usize),
    Selections,
}

/// A rank's answer to a command (`Truncate` has none).
enum Reply {
    Logits(Result<Vec<f32>>),
    Selections(Result<Vec<Selections>>),
}

/// How the ranks are made: each rank's device, and its plan on that device.
pub struct WorldSpec<'m, F, P> {
    pub world: usize,
    /// The device of a rank (its GPU, with its place in the world's communicator).
    pub device: F,
    /// The plan of a rank on its device (e.g. `DevicePlan::policy_shard`).
    pub plan: P,
    pub model: &'m Model,
    pub layout: Option<&'m SparseLayout>,
    pub n_ctx: usize,
}

/// The world's sequence, as one [`Decoder`].
pub struct ParallelDecoder {
    cmds: Vec<Sender<Cmd>>,
    replies: Receiver<(usize, Reply)>,
    len: usize,
    n_ctx: usize,
    logits: Vec<f32>,
}

/// Start the world of `spec`, run `body` on its decoder, then stop the ranks. A rank that fails
/// to start fails the call with its error.
pub fn run<D, F, P, R>(
    spec: WorldSpec<'_, F, P>,
    body: impl FnOnce(&mut ParallelDecoder) -> Result<R>,
) -> Result<R>
where
    D: Device,
    F: Fn(Shard) -> Result<D> + Sync,
    P: Fn(&D, &DeviceModel<D>, Shard) -> Result<DevicePlan<D>> + Sync,
{
    let shards = (0..spec.world)
        .map(|r| Shard::new(r, spec.world))
        .collect::<Result<Vec<_>>>()?;
    let (reply_tx, replies) = channel();
    std::thread::scope(|scope| {
        let mut cmds = Vec::new();
        for &shard in &shards {
            let (tx, rx) = channel();
            cmds.push(tx);
            let (reply_tx, spec) = (reply_tx.clone(), &spec);
            std::thread::Builder::new()
                .name(format!("tp-rank-{}", shard.rank))
                .spawn_scoped(scope, move || rank(spec, shard, rx, reply_tx))
                .map_err(|e| Error::Invalid(format!("starting rank {}: {e}", shard.rank)))?;
        }
        drop(reply_tx);
        // Every rank reports once it has started (or why it could not).
        for _ in &shards {
            match replies.recv() {
                Ok((_, Reply::Logits(Ok(_)))) => {}
                Ok((_, Reply::Logits(Err(e)))) => return Err(e),
                _ => return Err(Error::Invalid("a rank stopped while starting".into())),
            }
        }
        let mut dec = ParallelDecoder {
            cmds,
            replies,
            len: 0,
            n_ctx: spec.n_ctx,
            logits: vec![0.0; spec.model.config.vocab_size],
        };
        body(&mut dec)
        // Dropping the decoder closes the command channels: the ranks return.
    })
}

/// A rank's thread: start its device, shard and session, then serve commands until the
/// channel closes.
fn rank<D, F, P>(
    spec: &WorldSpec<'_, F, P>,
    shard: Shard,
    cmds: Receiver<Cmd>,
    out: Sender<(usize, Reply)>,
) where
    D: Device,
    F: Fn(Shard) -> Result<D> + Sync,
    P: Fn(&D, &DeviceModel<D>, Shard) -> Result<DevicePlan<D>> + Sync,
{
    let r = shard.rank;
    let started = (spec.device)(shard).and_then(|dev| {
        let model = DeviceModel::upload_shard(&dev, spec.model, spec.layout, shard)?;
        Ok((dev, model))
    });
    let (dev, model) = match started {
        Ok(x) => x,
        Err(e) => return drop(out.send((r, Reply::Logits(Err(e))))),
    };
    let session = (spec.plan)(&dev, &model, shard)
        .and_then(|plan| DeviceSession::new(&dev, &model, plan, spec.n_ctx));
    let mut session = match session {
        Ok(s) => s,
        Err(e) => return drop(out.send((r, Reply::Logits(Err(e))))),
    };
    if out.send((r, Reply::Logits(Ok(Vec::new())))).is_err() {
        return;
    }
    for cmd in cmds {
        let reply = match cmd {
            Cmd::Forward(tokens) => Reply::Logits(session.forward(&tokens).map(|l| match r {
                0 => l.to_vec(),
                _ => Vec::new(),
            })),
            Cmd::Truncate(len) => {
                session.truncate(len);
                continue;
            }
            Cmd::Selections => Reply::Selections(session.selections()),
        };
        if out.send((r, reply)).is_err() {
            return;
        }
    }
}

impl ParallelDecoder {
    pub fn world(&self) -> usize {
        self.cmds.len()
    }

    fn send(&self, cmd: impl Fn() -> Cmd) -> Result<()> {
        for tx in &self.cmds {
            tx.send(cmd())
                .map_err(|_| Error::Invalid("a tensor-parallel rank has stopped".into()))?;
        }
        Ok(())
    }

    /// Every rank's reply to the command just sent, by rank.
    fn gather(&self) -> Result<Vec<Reply>> {
        let mut got: Vec<Option<Reply>> = (0..self.world()).map(|_| None).collect();
        for _ in 0..self.world() {
            let (r, reply) = self
                .replies
                .recv()
                .map_err(|_| Error::Invalid("a tensor-parallel rank has stopped".into()))?;
            got[r] = Some(reply);
        }
        Ok(got.into_iter().flatten().collect())
    }

    /// The last step's selections of the world, per layer, in the whole model's numbering: each
    /// rank's, joined (`None`: every unit on every rank).
    pub fn selections(
        &mut self,
        c: &crate::engine::config::ModelConfig,
    ) -> Result<Vec<Selections>> {
        self.send(|| Cmd::Selections)?;
        let per_rank = self
            .gather()?
            .into_iter()
            .map(|r| match r {
                Reply::Selections(s) => s,
                Reply::Logits(_) => Err(Error::Invalid("a rank answered out of turn".into())),
            })
            .collect::<Result<Vec<_>>>()?;
        let world = self.world();
        let join = |sets: Vec<Option<Vec<u32>>>, n: usize| {
            if sets.iter().all(Option::is_none) {
                return None;
            }
            let mut all = Vec::new();
            for (r, s) in sets.into_iter().enumerate() {
                let own = Shard { rank: r, world }.part(n);
                all.extend(s.unwrap_or_else(|| own.map(|i| i as u32).collect()));
            }
            Some(all)
        };
        Ok((0..c.n_layers)
            .map(|l| {
                let (m, h): (Vec<_>, Vec<_>) = per_rank.iter().map(|s| s[l].clone()).unzip();
                (join(m, c.n_ff), join(h, c.n_heads))
            })
            .collect())
    }
}

impl Decoder for ParallelDecoder {
    fn decode(&mut self, tokens: &[u32]) -> Result<&mut [f32]> {
        self.send(|| Cmd::Forward(tokens.to_vec()))?;
        let mut replies = self.gather()?.into_iter();
        let mut first_err = None;
        for (r, reply) in replies.by_ref().enumerate() {
            match reply {
                Reply::Logits(Ok(l)) if r == 0 => self.logits = l,
                Reply::Logits(Ok(_)) => {}
                Reply::Logits(Err(e)) => {
                    first_err.get_or_insert(e);
                }
                Reply::Selections(_) => {
                    first_err.get_or_insert(Error::Invalid("a rank answered out of turn".into()));
                }
            }
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        self.len += tokens.len();
        Ok(&mut self.logits)
    }
    fn len(&self) -> usize {
        self.len
    }
    fn n_ctx(&self) -> usize {
        self.n_ctx
    }
    fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
        let _ = self.send(|| Cmd::Truncate(len));
    }
}
