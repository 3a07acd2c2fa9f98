//! The output head of one row (a decode step's, or a prompt's last): dense, or contextual
//! (`head:RANK:CANDIDATES`), whose logits are then checked against its bound on the host and
//! replaced by the dense head's where it may not hold (see [`crate::sparsity::head_bound`]).
use super::step::norm;
use super::{collective, Clock, DeviceSession};
use crate::sparsity::head_bound::{self, Check};
use crate::Result;
use dejavu_backend_api::{Device, Rows};

/// The buffer of scratch `$s` the output head of model `$m` reads (after [`DeviceSession::output`]'s
/// norm and projection); a macro, so the other fields of `$s` stay free to borrow.
macro_rules! head_in {
    ($m:expr, $s:expr) => {
        match (&$m.proj_out, &$m.output_norm) {
            (Some(_), _) => &$s.e,
            (None, Some(_)) => &$s.h,
            (None, None) => &$s.x,
        }
    };
}

impl<D: Device> DeviceSession<'_, D> {
    /// The output head of `s.x` (one row) into `s.logits`: dense, or contextual (the preview
    /// scores every token, the top candidates get exact logits, and their preview logits are
    /// kept for [`Self::bound_head`]). Under tensor parallelism each rank's logits of its
    /// vocabulary rows are gathered.
    pub(super) fn output(&mut self, clock: &mut Option<Clock>) -> Result<()> {
        let (dev, m, s) = (self.dev, self.model, &mut self.s);
        let c = &m.local;
        if let Some(n) = &m.output_norm {
            norm(dev, c, n, &s.x, &mut s.h, 1)?;
        }
        if let Some(p) = &m.proj_out {
            let head_in = if m.output_norm.is_some() { &s.h } else { &s.x };
            dev.matvec(p, Rows::All, head_in, None, &mut s.e, false)?;
        }
        match &mut self.plan.output {
            None => self.dense_head(clock)?,
            Some(o) => {
                let head_in = head_in!(m, s);
                let vocab = c.vocab_size;
                dev.matvec(&o.proj, Rows::All, head_in, None, &mut s.z[0], false)?;
                dev.matvec(&o.table, Rows::All, &s.z[0], None, &mut s.logits, false)?;
                dev.top_k(&s.logits, vocab, o.candidates, &mut o.idx)?;
                dev.gather(&s.logits, &o.idx, o.candidates, 1, &mut o.preview)?;
                let cand = Rows::Sel {
                    idx: &o.idx,
                    count: o.candidates,
                    group: 1,
                };
                dev.matvec(m.head(), cand, head_in, None, &mut s.exact, false)?;
                dev.scatter(&s.exact, &o.idx, o.candidates, 1, &mut s.logits)?;
            }
        }
        self.cap_logits()
    }

    /// The dense head of the head's input into `s.logits` (before the soft cap).
    fn dense_head(&mut self, clock: &mut Option<Clock>) -> Result<()> {
        let (dev, m) = (self.dev, self.model);
        let c = &m.local;
        let s = &mut self.s;
        let head_in = head_in!(m, s);
        if m.shard.is_whole() {
            return Ok(dev.matvec(m.head(), Rows::All, head_in, None, &mut s.logits, false)?);
        }
        let per = m.shard.vocab_per_rank(c.vocab_size);
        let part = &mut s.part_logits;
        dev.matvec(m.head(), Rows::All, head_in, None, part, false)?;
        collective(
            clock,
            dev,
            |t| &mut t.output,
            || Ok(dev.all_gather(&s.part_logits, per, &mut s.logits)?),
        )
    }

    fn cap_logits(&mut self) -> Result<()> {
        let c = &self.model.local;
        if let Some(cap) = c.final_softcap {
            self.dev
                .scale_cap(&mut self.s.logits, c.vocab_size, 1.0, Some(cap))?;
        }
        Ok(())
    }

    /// After [`Self::output`] under a contextual head: its logits `out` (as downloaded from
    /// `s.logits`) checked against the bound, with the non-candidates raised by it; where the
    /// bound may not hold, the dense head's logits into `s.logits` and `out`. Records whether
    /// the step fell back (its bytes, [`Self::last_step`]). A dense head: nothing to do.
    pub(super) fn bound_head(&mut self, out: &mut [f32]) -> Result<()> {
        let (dev, cap) = (self.dev, self.model.local.final_softcap);
        let Some(o) = &mut self.plan.output else {
            return Ok(());
        };
        o.host_idx.resize(o.candidates, 0);
        dev.download_idx(&o.idx, &mut o.host_idx)?;
        o.host_preview.resize(o.candidates, 0.0);
        dev.download(&o.preview, &mut o.host_preview)?;
        let (cand, preview) = (&o.host_idx, &mut o.host_preview);
        if let Some(k) = cap {
            preview.iter_mut().for_each(|p| *p = k * (*p / k).tanh());
        }
        let delta = head_bound::delta(out, cand, preview, &mut o.scratch);
        self.head_fell_back = head_bound::check(out, cand, delta, &mut o.scratch) == Check::Dense;
        if self.head_fell_back {
            self.dense_head(&mut None)?;
            self.cap_logits()?;
            dev.download(&self.s.logits, out)?;
        }
        Ok(())
    }
}
