//! A tensor-parallel world in one process: a thread per rank, each with its own device, its
//! [`Shard`] of the model and its sessions (one per plan), driven in lock step by a
//! [`ParallelDecoder`] (every rank runs every step, so every rank reaches the same collectives
//! in the same order). The logits are the world's (each rank holds them after the all-gather);
//! rank 0's are returned.
use super::Shard;
use crate::exec::Decoder;
use crate::exec::{BlockTimes, DeviceModel, DevicePlan, DeviceSession, Selections, SessionInfo};
use crate::model::config::ModelConfig;
use crate::model::weights::Model;
use crate::sparsity::layout::SparseLayout;
use crate::{Error, Result};
use dejavu_backend_api::Device;
use std::sync::mpsc::{channel, Receiver, Sender};

/// What the rank threads are asked to do, each of one of their sessions.
enum Cmd {
    Forward(usize, Vec<u32>),
    Truncate(usize, usize),
    Selections(usize),
    Profile(usize, Vec<u32>),
    Info(usize),
}

/// A rank's answer to a command (`Truncate` has none), or its start.
enum Reply {
    /// Started, with this many sessions (or why not).
    Started(Result<usize>),
    Logits(Result<Vec<f32>>),
    Selections(Result<Vec<Selections>>),
    Profile(Result<BlockTimes>),
    Info(Result<SessionInfo>),
}

/// How the ranks are made: each rank's device, and its plans on that device (a session each).
pub struct WorldSpec<'m, F, P> {
    pub world: usize,
    /// The device of a rank (its GPU, with its place in the world's communicator).
    pub device: F,
    /// The plans of a rank on its device (e.g. `DevicePlan::policy_shard`), the same number on
    /// every rank.
    pub plans: P,
    pub model: &'m Model,
    pub layout: Option<&'m SparseLayout>,
    pub n_ctx: usize,
}

/// The world's sequences, one per plan, as one [`Decoder`] over the one [`Self::select`]ed.
pub struct ParallelDecoder {
    cmds: Vec<Sender<Cmd>>,
    replies: Receiver<(usize, Reply)>,
    /// Tokens in each session's cache, and the session the decoder runs.
    lens: Vec<usize>,
    current: usize,
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
    P: Fn(&D, &DeviceModel<D>, Shard) -> Result<Vec<DevicePlan<D>>> + Sync,
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
        // Every rank reports once it has started, with its sessions' count (or why it could
        // not start).
        let mut n_sessions = 0;
        for _ in &shards {
            match replies.recv() {
                Ok((_, Reply::Started(Ok(n)))) => n_sessions = n,
                Ok((_, Reply::Started(Err(e)))) => return Err(e),
                _ => return Err(Error::Invalid("a rank stopped while starting".into())),
            }
        }
        let mut dec = ParallelDecoder {
            cmds,
            replies,
            lens: vec![0; n_sessions],
            current: 0,
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
    P: Fn(&D, &DeviceModel<D>, Shard) -> Result<Vec<DevicePlan<D>>> + Sync,
{
    let r = shard.rank;
    let started = (spec.device)(shard).and_then(|dev| {
        let model = DeviceModel::upload_shard(&dev, spec.model, spec.layout, shard)?;
        Ok((dev, model))
    });
    let (dev, model) = match started {
        Ok(x) => x,
        Err(e) => return drop(out.send((r, Reply::Started(Err(e))))),
    };
    let sessions = (spec.plans)(&dev, &model, shard).and_then(|plans| {
        (plans.into_iter())
            .map(|plan| DeviceSession::new(&dev, &model, plan, spec.n_ctx))
            .collect::<Result<Vec<_>>>()
    });
    let sessions = sessions.and_then(|s| match s.is_empty() {
        true => Err(Error::Invalid("a tensor-parallel world of no plan".into())),
        false => Ok(s),
    });
    let mut sessions = match sessions {
        Ok(s) => s,
        Err(e) => return drop(out.send((r, Reply::Started(Err(e))))),
    };
    if out.send((r, Reply::Started(Ok(sessions.len())))).is_err() {
        return;
    }
    for cmd in cmds {
        let reply = match cmd {
            Cmd::Forward(i, tokens) => {
                Reply::Logits(sessions[i].forward(&tokens).map(|l| match r {
                    0 => l.to_vec(),
                    _ => Vec::new(),
                }))
            }
            Cmd::Truncate(i, len) => {
                sessions[i].truncate(len);
                continue;
            }
            Cmd::Selections(i) => Reply::Selections(sessions[i].selections()),
            Cmd::Profile(i, tokens) => {
                let mut t = BlockTimes::default();
                Reply::Profile(sessions[i].profile(&tokens, &mut t).map(|_| t))
            }
            Cmd::Info(i) => Reply::Info(sessions[i].info()),
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

    /// Sessions (plans) on every rank.
    pub fn sessions(&self) -> usize {
        self.lens.len()
    }

    /// Run session `i` from now on.
    pub fn select(&mut self, i: usize) -> Result<()> {
        if i >= self.sessions() {
            return Err(Error::Invalid(format!(
                "session {i} of a world of {} sessions",
                self.sessions()
            )));
        }
        self.current = i;
        Ok(())
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
    pub fn selections(&mut self, c: &ModelConfig) -> Result<Vec<Selections>> {
        let i = self.current;
        self.send(|| Cmd::Selections(i))?;
        let per_rank = (self.gather()?.into_iter())
            .map(|r| match r {
                Reply::Selections(s) => s,
                _ => Err(out_of_turn()),
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

    /// `DeviceSession::profile` of `tokens` on every rank; rank 0's block times added to
    /// `times`.
    pub fn profile(&mut self, tokens: &[u32], times: &mut BlockTimes) -> Result<()> {
        let i = self.current;
        self.send(|| Cmd::Profile(i, tokens.to_vec()))?;
        let mut first = None;
        for (r, reply) in self.gather()?.into_iter().enumerate() {
            match reply {
                Reply::Profile(Ok(t)) if r == 0 => first = Some(t),
                Reply::Profile(Ok(_)) => {}
                Reply::Profile(Err(e)) => return Err(e),
                _ => return Err(out_of_turn()),
            }
        }
        let t = first.ok_or_else(out_of_turn)?;
        times.add(&t);
        self.lens[i] += tokens.len();
        Ok(())
    }

    /// Each rank's view of the current session, by rank.
    pub fn info(&mut self) -> Result<Vec<SessionInfo>> {
        let i = self.current;
        self.send(|| Cmd::Info(i))?;
        (self.gather()?.into_iter())
            .map(|r| match r {
                Reply::Info(info) => info,
                _ => Err(out_of_turn()),
            })
            .collect()
    }
}

fn out_of_turn() -> Error {
    Error::Invalid("a tensor-parallel rank answered out of turn".into())
}

impl Decoder for ParallelDecoder {
    fn decode(&mut self, tokens: &[u32]) -> Result<&mut [f32]> {
        let i = self.current;
        self.send(|| Cmd::Forward(i, tokens.to_vec()))?;
        let mut first_err = None;
        for (r, reply) in self.gather()?.into_iter().enumerate() {
            match reply {
                Reply::Logits(Ok(l)) if r == 0 => self.logits = l,
                Reply::Logits(Ok(_)) => {}
                Reply::Logits(Err(e)) => {
                    first_err.get_or_insert(e);
                }
                _ => {
                    first_err.get_or_insert(out_of_turn());
                }
            }
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        self.lens[i] += tokens.len();
        Ok(&mut self.logits)
    }
    fn len(&self) -> usize {
        self.lens[self.current]
    }
    fn n_ctx(&self) -> usize {
        self.n_ctx
    }
    fn truncate(&mut self, len: usize) {
        let i = self.current;
        self.lens[i] = self.lens[i].min(len);
        let _ = self.send(|| Cmd::Truncate(i, len));
    }
}
