//! [`HostWorld`]: the scalar reference of the collectives (`Device::all_reduce`,
//! `Device::all_gather`) for [`crate::device::CpuDevice`] ranks that are threads of one
//! process. It is what tensor parallelism is checked against on machines without GPUs (NCCL is
//! the real transport on GPUs): every rank hands its vector in, waits for the others, and reads
//! every rank's, so the sums are taken in rank order and are the same on every rank.
use dejavu_backend_api::BackendError;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// How long a rank waits for the others before a collective fails (a rank that stopped early
/// must not hang the rest).
const PATIENCE: Duration = Duration::from_secs(120);

/// The ranks' meeting point.
pub struct HostWorld {
    size: usize,
    state: Mutex<Round>,
    turn: Condvar,
}

/// One collective in progress: the vectors handed in, and how many ranks have read them.
struct Round {
    /// Counts the rounds, so a rank waiting on one is not woken by the next.
    generation: u64,
    slots: Vec<Option<Vec<f32>>>,
    read: usize,
}

impl HostWorld {
    pub fn new(size: usize) -> Arc<Self> {
        Arc::new(Self {
            size,
            state: Mutex::new(Round {
                generation: 0,
                slots: vec![None; size],
                read: 0,
            }),
            turn: Condvar::new(),
        })
    }

    pub fn size(&self) -> usize {
        self.size
    }

    /// Every rank's `x`, in rank order: each rank calls this for the same collective.
    fn exchange(&self, rank: usize, x: &[f32]) -> Result<Vec<Vec<f32>>, BackendError> {
        let late =
            || BackendError::Device(format!("rank {rank}: a rank did not reach a collective"));
        let mut st = self.state.lock().map_err(|_| late())?;
        // A rank that runs ahead waits until the previous round has been read by everyone.
        while st.slots[rank].is_some() {
            let (s, t) = self.turn.wait_timeout(st, PATIENCE).map_err(|_| late())?;
            st = s;
            if t.timed_out() {
                return Err(late());
            }
        }
        st.slots[rank] = Some(x.to_vec());
        let generation = st.generation;
        if st.slots.iter().all(Option::is_some) {
            st.generation += 1;
            self.turn.notify_all();
        }
        while st.generation == generation {
            let (s, t) = self.turn.wait_timeout(st, PATIENCE).map_err(|_| late())?;
            st = s;
            if t.timed_out() && st.generation == generation {
                st.slots[rank] = None;
                return Err(late());
            }
        }
        let all: Vec<Vec<f32>> = st
            .slots
            .iter()
            .map(|s| s.clone().unwrap_or_default())
            .collect();
        st.read += 1;
        if st.read == self.size {
            st.read = 0;
            st.slots.iter_mut().for_each(|s| *s = None);
            self.turn.notify_all();
        }
        Ok(all)
    }

    /// `x` = the sum of every rank's `x`, added in rank order.
    pub fn all_reduce(&self, rank: usize, x: &mut [f32]) -> Result<(), BackendError> {
        let all = self.exchange(rank, x)?;
        for (i, v) in x.iter_mut().enumerate() {
            *v = all.iter().fold(0.0, |s, r| s + r[i]);
        }
        Ok(())
    }

    /// `out[r * n..(r + 1) * n]` = rank `r`'s `x` (`n = x.len()`).
    pub fn all_gather(&self, rank: usize, x: &[f32], out: &mut [f32]) -> Result<(), BackendError> {
        let all = self.exchange(rank, x)?;
        for (o, r) in out.chunks_mut(x.len().max(1)).zip(&all) {
            o.copy_from_slice(&r[..o.len()]);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_sum_and_gather_in_rank_order_over_many_rounds() {
        let w = HostWorld::new(3);
        let handles: Vec<_> = (0..3)
            .map(|rank| {
                let w = w.clone();
                std::thread::spawn(move || {
                    for round in 0..200 {
                        let mut x = vec![(rank * 10 + round) as f32; 4];
                        w.all_reduce(rank, &mut x).unwrap();
                        assert_eq!(x, vec![(30 + 3 * round) as f32; 4], "round {round}");
                        let mut out = vec![0.0; 6];
                        w.all_gather(rank, &[rank as f32, round as f32], &mut out)
                            .unwrap();
                        let r = round as f32;
                        assert_eq!(out, vec![0.0, r, 1.0, r, 2.0, r]);
                    }
                })
            })
            .collect();
        handles.into_iter().for_each(|h| h.join().unwrap());
    }
}
