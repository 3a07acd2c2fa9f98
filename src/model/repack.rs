//! The load-time conversion of the matrices the executor multiplies into the layout its backend
//! reads fastest (`Backend::repack`: the CPU backend's interleaved groups for Q8_0, Q4_0, Q4_1 and
//! Q5_0 rows). An explicit step of `Engine::load`, like the sparse layout's transposes, but kept
//! in memory: converting is a permutation of bytes that runs at memory speed (measured below a
//! second for Qwen2.5-0.5B: 0.45-0.95 s to load and decode one token against 0.33-0.42 s with
//! `--no-repack`), and the file's pages are released as each tensor is converted (peak RSS 444
//! against 441 MB).
use crate::model::weights::{Model, Source, WeightRef, CONVERTED};
use crate::progress;
use crate::{Error, Result};
use dejavu_backend_api::{Backend, RowLayout, Weight};
use std::collections::BTreeMap;

impl Model {
    /// Convert every matrix the executor multiplies (output head, projections, layer matrices)
    /// whose type `backend` repacks. A mapped model's matrices are copied into one anonymous
    /// buffer and the file's pages of them released; a synthetic model's are converted in place.
    /// Every `WeightRef` of a converted range (a tied embedding too) reads the new layout.
    pub fn repack(&mut self, backend: &dyn Backend) -> Result<()> {
        // Distinct ranges to convert, by location: (file, start) -> a representative ref.
        let mut todo: BTreeMap<(usize, usize), WeightRef> = BTreeMap::new();
        let multiplied = self
            .layers
            .iter()
            .flat_map(|l| l.matrices())
            .chain([&self.output])
            .chain(self.proj_in.iter().chain(&self.proj_out));
        for w in multiplied {
            if w.layout == RowLayout::Ggml && backend.repacks(w.qtype) {
                todo.entry(w.location()).or_insert_with(|| w.clone());
            }
        }
        let bytes: usize = todo.values().map(WeightRef::n_bytes).sum();
        if todo.is_empty() {
            return Ok(());
        }
        let bar = progress::bytes_bar(bytes as u64, "repacking weights");
        let mut moved = BTreeMap::new();
        if let Source::Synthetic(s) = &mut self.source {
            for (&(file, start), w) in &todo {
                // Unshared while the model loads (no device holds it yet).
                let buf = std::sync::Arc::get_mut(&mut s.buffers[file]).ok_or_else(|| {
                    Error::Invalid("repacking a model whose weights a device holds".into())
                })?;
                let dst = &mut buf[start..start + w.n_bytes()];
                let src = dst.to_vec();
                let view = Weight::new(w.qtype, w.rows, w.cols, &src)
                    .map_err(|e| Error::Invalid(e.to_string()))?;
                let layout = backend.repack(&view, dst);
                moved.insert((file, start), ((file, start), layout));
                bar.inc(w.n_bytes() as u64);
            }
        } else {
            let mut buf = crate::memstat::huge_zeroed(bytes)?;
            let mut at = 0;
            for (&(file, start), w) in &todo {
                let view = self.weight(w);
                let layout = backend.repack(&view, &mut buf[at..at + w.n_bytes()]);
                moved.insert((file, start), ((CONVERTED, at), layout));
                at += w.n_bytes();
                bar.inc(w.n_bytes() as u64);
                // Released as we go, so the peak stays near one copy of the weights.
                if let Source::Gguf(f) = &self.source {
                    f.release(start, w.n_bytes());
                }
            }
            self.converted = Some(std::sync::Arc::new(buf));
        }
        bar.finish_and_clear();
        let refs = self
            .layers
            .iter_mut()
            .flat_map(|l| l.matrices_mut())
            .chain([&mut self.output, &mut self.token_embd])
            .chain(self.pos_embd.iter_mut())
            .chain(self.proj_in.iter_mut().chain(self.proj_out.iter_mut()));
        for w in refs {
            if let Some(&(to, layout)) = moved.get(&w.location()) {
                w.relocate(to, layout);
            }
        }
        Ok(())
    }
}
