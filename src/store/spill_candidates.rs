//! Which blocks in memory the block store writes out next when memory is full: per spill
//! group, its blocks in memory that no spill is writing out now, kept beside the store's
//! map so that choosing a run does not walk every block of the query (tens of thousands in
//! a range sort, where that walk took 6% of the CPU time). The group with the most bytes
//! goes first, blocks waiting for a reader that needs all of them before blocks read soon
//! ([`ReadSoon`]), and within a group its newest blocks (readers take the oldest first).

use std::collections::{BTreeMap, HashMap};

use crate::store::block::BlockId;
use crate::store::spill_runs::SpillGroup;

/// The producers whose blocks are read soon after they are made (by tasks that start as
/// they arrive, such as an out-of-core range sort's run sorts); the others' blocks wait for
/// a reader that needs all of them (an exchange's reduce side). When memory is full, blocks
/// waiting for such a reader are written out first, and a block read soon that finds memory
/// full makes room by writing them out instead of being written out itself: each block
/// then goes to disk at most once, as the run it becomes, not also as the map output it was.
#[derive(Debug, Default, Clone)]
pub struct ReadSoon(Vec<bool>);

impl ReadSoon {
    /// Producers whose blocks are read soon: `read_soon[op]` for operator `op`.
    pub fn new(read_soon: Vec<bool>) -> Self {
        Self(read_soon)
    }

    /// Whether operator `op`'s blocks are read soon.
    pub(crate) fn contains(&self, op: usize) -> bool {
        self.0.get(op).copied().unwrap_or(false)
    }
}

/// One group's blocks in memory and not being written out.
#[derive(Default)]
struct Resident {
    bytes: u64,
    /// Each block's bytes, by id (newest last).
    blocks: BTreeMap<BlockId, u64>,
}

/// The blocks a spill may write out, by group.
#[derive(Default)]
pub(crate) struct SpillCandidates {
    groups: HashMap<SpillGroup, Resident>,
}

impl SpillCandidates {
    /// Block `id` of `group`, of `bytes`, is in memory and may be written out.
    pub(crate) fn add(&mut self, group: SpillGroup, id: BlockId, bytes: u64) {
        let resident = self.groups.entry(group).or_default();
        if resident.blocks.insert(id, bytes).is_none() {
            resident.bytes += bytes;
        }
    }

    /// Block `id` of `group` is no longer a candidate (released, written out, or being
    /// written).
    pub(crate) fn forget(&mut self, group: SpillGroup, id: BlockId) {
        if let Some(resident) = self.groups.get_mut(&group)
            && let Some(bytes) = resident.blocks.remove(&id)
        {
            resident.bytes -= bytes;
            if resident.blocks.is_empty() {
                self.groups.remove(&group);
            }
        }
    }

    /// Of `group`'s candidates, its newest while their bytes stay under `bytes` (at least
    /// one), no longer candidates: they are the caller's to write out or add back.
    pub(crate) fn take_newest(&mut self, group: SpillGroup, bytes: u64) -> Vec<BlockId> {
        let Some(resident) = self.groups.get(&group) else {
            return vec![];
        };
        let mut chosen = vec![];
        let mut total = 0;
        for (&id, &size) in resident.blocks.iter().rev() {
            if total >= bytes {
                break;
            }
            total += size;
            chosen.push(id);
        }
        for &id in &chosen {
            self.forget(group, id);
        }
        chosen
    }

    /// The group with the most bytes of candidates (ties: the newest), among those
    /// `read_soon` says are not read soon if any has such bytes, else among all.
    pub(crate) fn fullest_group(&self, read_soon: &ReadSoon) -> Option<SpillGroup> {
        self.fullest_read_late(read_soon)
            .or_else(|| self.fullest_where(|_| true))
    }

    /// The group not read soon ([`ReadSoon`]) with the most bytes of candidates (ties: the
    /// newest).
    pub(crate) fn fullest_read_late(&self, read_soon: &ReadSoon) -> Option<SpillGroup> {
        self.fullest_where(|group| !read_soon.contains(group.0))
    }

    /// The group `keep` keeps with the most bytes of candidates (ties: the newest).
    fn fullest_where(&self, keep: impl Fn(&SpillGroup) -> bool) -> Option<SpillGroup> {
        self.groups
            .iter()
            .filter(|(group, _)| keep(group))
            .filter_map(|(group, r)| Some((r.bytes, *r.blocks.keys().next_back()?, *group)))
            .max()
            .map(|(.., group)| group)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fullest_group_read_late_goes_first_its_newest_blocks_first() {
        let mut candidates = SpillCandidates::default();
        // Operator 0's blocks are read soon; operator 1's wait for a reader of all.
        let read_soon = ReadSoon::new(vec![true, false]);
        for id in 0..4 {
            candidates.add((0, 0), id, 100);
        }
        candidates.add((1, 0), 10, 50);
        candidates.add((1, 0), 11, 50);
        assert_eq!(candidates.fullest_group(&read_soon), Some((1, 0)));
        assert_eq!(candidates.take_newest((1, 0), 40), vec![11]);
        assert_eq!(candidates.take_newest((1, 0), 1000), vec![10]);
        // Nothing read late is left: the fullest of all.
        assert_eq!(candidates.fullest_group(&read_soon), Some((0, 0)));
        assert_eq!(candidates.fullest_read_late(&read_soon), None);
        assert_eq!(candidates.take_newest((0, 0), 150), vec![3, 2]);
        candidates.forget((0, 0), 0);
        candidates.forget((0, 0), 1);
        assert_eq!(candidates.fullest_group(&read_soon), None);
    }

    #[test]
    fn ties_go_to_the_group_with_the_newest_block() {
        let mut candidates = SpillCandidates::default();
        candidates.add((0, 0), 1, 100);
        candidates.add((2, 0), 5, 100);
        candidates.add((1, 0), 3, 100);
        assert_eq!(candidates.fullest_group(&ReadSoon::default()), Some((2, 0)));
    }
}
