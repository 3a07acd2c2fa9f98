//! A validated subset of `0..universe`: sorted, unique, in range. The full set is its own variant so
//! the dense path costs nothing and is recognisable (`is_full`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexSet {
    universe: usize,
    /// `None` = every index of the universe.
    indices: Option<Vec<u32>>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IndexSetError {
    #[error("index {index} out of range for a set over 0..{universe}")]
    OutOfRange { index: u32, universe: usize },
    #[error("indices must be strictly increasing (found {prev} then {next})")]
    NotSorted { prev: u32, next: u32 },
}

impl IndexSet {
    pub fn full(universe: usize) -> Self {
        Self {
            universe,
            indices: None,
        }
    }

    /// A subset; `indices` must be strictly increasing and below `universe`.
    pub fn new(universe: usize, indices: Vec<u32>) -> Result<Self, IndexSetError> {
        for w in indices.windows(2) {
            if w[0] >= w[1] {
                return Err(IndexSetError::NotSorted {
                    prev: w[0],
                    next: w[1],
                });
            }
        }
        if let Some(&last) = indices.last() {
            if last as usize >= universe {
                return Err(IndexSetError::OutOfRange {
                    index: last,
                    universe,
                });
            }
        }
        if indices.len() == universe {
            return Ok(Self::full(universe));
        }
        Ok(Self {
            universe,
            indices: Some(indices),
        })
    }

    /// A subset from any order, with duplicates removed.
    pub fn from_unsorted(universe: usize, mut indices: Vec<u32>) -> Result<Self, IndexSetError> {
        indices.sort_unstable();
        indices.dedup();
        Self::new(universe, indices)
    }

    pub fn universe(&self) -> usize {
        self.universe
    }
    #[inline]
    pub fn len(&self) -> usize {
        self.indices.as_ref().map_or(self.universe, Vec::len)
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn is_full(&self) -> bool {
        self.indices.is_none()
    }
    /// Fraction of the universe kept.
    pub fn density(&self) -> f64 {
        if self.universe == 0 {
            1.0
        } else {
            self.len() as f64 / self.universe as f64
        }
    }
    #[inline]
    pub fn get(&self, i: usize) -> usize {
        self.indices.as_ref().map_or(i, |v| v[i] as usize)
    }
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.len()).map(move |i| self.get(i))
    }
    #[inline]
    pub fn contains(&self, x: usize) -> bool {
        match &self.indices {
            None => x < self.universe,
            Some(v) => v.binary_search(&(x as u32)).is_ok(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation() {
        assert!(IndexSet::new(4, vec![0, 2]).is_ok());
        assert_eq!(
            IndexSet::new(4, vec![2, 2]),
            Err(IndexSetError::NotSorted { prev: 2, next: 2 })
        );
        assert_eq!(
            IndexSet::new(4, vec![1, 4]),
            Err(IndexSetError::OutOfRange {
                index: 4,
                universe: 4
            })
        );
        assert!(IndexSet::new(3, vec![0, 1, 2]).unwrap().is_full());
        let s = IndexSet::from_unsorted(10, vec![7, 1, 7, 3]).unwrap();
        assert_eq!(s.iter().collect::<Vec<_>>(), vec![1, 3, 7]);
        assert!(s.contains(3) && !s.contains(4));
        assert_eq!(IndexSet::full(5).iter().count(), 5);
    }
}
