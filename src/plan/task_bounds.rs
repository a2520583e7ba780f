//! The bounds an operator's tasks have made so far, handed to the tasks launched after them.
//!
//! Each task runs its aggregates and TopK sorts with dynamic filters of its own
//! ([`crate::plan::dynamic_filters::for_one_task`]), so that a task run again makes what its
//! first run made. Left at that, a bound pruned only its own task's scan: `min(x)` over a
//! table sorted by `x` read every split, where DataFusion's shared filter lets the splits
//! read after the first skip their row groups.
//!
//! So a running task's bounds count here as they tighten ([`BoundsMade::running`]), and
//! stay when it ends; a task launched later starts from what is here then
//! ([`BoundsMade::at_launch`]: DataFusion's filter as it was at that moment), which it keeps
//! for every run of it: its scans prune by that and by its own bound (a scan in another
//! operator by that alone). A run again therefore never meets a bound made from its own
//! rows, which is what broke recovery when tasks shared DataFusion's filter. The bounds it
//! does meet hold: each was made from rows some task had seen, and that task's output is
//! kept or, lost, made again from the same input blocks and the same starting bounds, so
//! made again the same.
//!
//! Bounds of one filter are merged: `x < 10` and `x < 7` make `x < 7`, and two
//! `x < a OR y > b` make one with the smaller `a` and the larger `b`. For the shapes
//! DataFusion's aggregates and TopK sorts make, that is the bound of both tasks' rows
//! together. Bounds of other shapes (a TopK over several keys whose first keys differ) are
//! kept as a conjunction, each holding for every row that can still change the answer, at
//! most [`MAX_CONJUNCTS`] of them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use datafusion::common::ScalarValue;
use datafusion::logical_expr::Operator;
use datafusion::physical_expr::expressions::{BinaryExpr, DynamicFilterPhysicalExpr, Literal, lit};
use datafusion::physical_plan::PhysicalExpr;

/// Most bounds of one filter kept as a conjunction when they cannot be merged into one; the
/// oldest is dropped beyond it (a bound dropped prunes less, never wrongly).
pub const MAX_CONJUNCTS: usize = 4;

/// The bounds a task starts from: by the expression id of the dynamic filter each applies
/// to, a filter fixed at that bound, on the columns of that filter's producer (a reader
/// puts it on its own columns with `with_new_children`, as it does the filter itself).
pub type LaunchBounds = Arc<HashMap<u64, Arc<dyn PhysicalExpr>>>;

/// A bound a task ended with.
#[derive(Debug, Clone)]
pub struct MadeBound {
    /// The expression id of the operator's dynamic filter it is a bound of.
    pub filter: u64,
    /// The columns of that filter's producer, which `value` reads.
    pub columns: Vec<Arc<dyn PhysicalExpr>>,
    /// The bound: `true` for none.
    pub value: Arc<dyn PhysicalExpr>,
}

/// A running task's own filter: `(id of the operator's filter it replaces, the task's
/// filter on its producer's columns)`.
pub type TaskFilter = (u64, Arc<dyn PhysicalExpr>);

/// The bounds of one filter.
#[derive(Debug, Clone)]
struct Kept {
    columns: Vec<Arc<dyn PhysicalExpr>>,
    /// Each holds; at most [`MAX_CONJUNCTS`], oldest first.
    bounds: Vec<Arc<dyn PhysicalExpr>>,
}

impl Kept {
    /// Add `value`: merged into the bound of its shape, else beside them. Whether that
    /// changed them.
    fn add(&mut self, value: Arc<dyn PhysicalExpr>) -> bool {
        if is_true(&value) {
            return false;
        }
        match self.bounds.iter().position(|k| merged(k, &value).is_some()) {
            Some(at) => {
                let tighter = merged(&self.bounds[at], &value).unwrap();
                if tighter.as_ref() == self.bounds[at].as_ref() {
                    return false;
                }
                self.bounds[at] = tighter;
            }
            None => {
                self.bounds.push(value);
                if self.bounds.len() > MAX_CONJUNCTS {
                    self.bounds.remove(0);
                }
            }
        }
        true
    }
}

/// The bounds a run's tasks have made so far (see the module doc).
#[derive(Debug, Default)]
pub struct BoundsMade {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    /// The bounds of ended tasks, by filter.
    by_filter: HashMap<u64, Kept>,
    /// The running tasks' own filters, by a key of the run.
    running: HashMap<u64, Vec<TaskFilter>>,
    next_key: u64,
    /// Changes to `by_filter` and `running` so far.
    version: u64,
    /// [`BoundsMade::at_launch`]'s last answer, with the version and the running filters'
    /// generations it was made at.
    launch: Option<(u64, u64, LaunchBounds)>,
}

impl BoundsMade {
    /// What a task launched now starts from: the bounds of ended tasks and the running
    /// tasks' bounds so far.
    pub fn at_launch(&self) -> LaunchBounds {
        let mut inner = self.inner.lock().unwrap();
        // Updates only raise a filter's generation, so an unchanged sum is no update.
        let generations: u64 = (inner.running.values().flatten())
            .map(|(_, filter)| filter.snapshot_generation())
            .sum();
        if let Some((version, at, launch)) = &inner.launch
            && *version == inner.version
            && *at == generations
        {
            return Arc::clone(launch);
        }
        let mut by_filter = inner.by_filter.clone();
        for (id, filter) in inner.running.values().flatten() {
            if let Ok(Some(value)) = filter.snapshot() {
                let columns = filter.children().into_iter().cloned().collect();
                (by_filter.entry(*id))
                    .or_insert_with(|| Kept {
                        columns,
                        bounds: vec![],
                    })
                    .add(value);
            }
        }
        let launch: LaunchBounds = Arc::new(
            (by_filter.into_iter())
                .filter_map(|(id, kept)| {
                    let bound = conjunction(&kept.bounds)?;
                    let fixed = DynamicFilterPhysicalExpr::new(kept.columns, lit(true));
                    fixed.update(bound).ok()?;
                    Some((id, Arc::new(fixed) as Arc<dyn PhysicalExpr>))
                })
                .collect(),
        );
        inner.launch = Some((inner.version, generations, Arc::clone(&launch)));
        launch
    }

    /// Add the bounds a task ended with.
    pub fn add(&self, made: impl IntoIterator<Item = MadeBound>) {
        let mut inner = self.inner.lock().unwrap();
        let mut changed = false;
        for MadeBound {
            filter,
            columns,
            value,
        } in made
        {
            let kept = inner.by_filter.entry(filter).or_insert_with(|| Kept {
                columns,
                bounds: vec![],
            });
            changed |= kept.add(value);
        }
        if changed {
            inner.version += 1;
        }
    }

    /// Count a running task's own filters (`(filter id, the task's filter)`, each on its
    /// producer's columns) in every launch from now on, until the guard it returns is
    /// dropped, which adds their values then.
    pub fn running(&self, filters: Vec<TaskFilter>) -> Running<'_> {
        if filters.is_empty() {
            return Running {
                bounds: self,
                key: None,
            };
        }
        let mut inner = self.inner.lock().unwrap();
        let key = inner.next_key;
        inner.next_key += 1;
        inner.running.insert(key, filters);
        inner.version += 1;
        Running {
            bounds: self,
            key: Some(key),
        }
    }
}

/// A running task's own filters, counted in launches until it is dropped
/// ([`BoundsMade::running`]).
#[derive(Debug)]
pub struct Running<'a> {
    bounds: &'a BoundsMade,
    /// Its key in `running`; `None` for a task with no filter of its own.
    key: Option<u64>,
}

impl Drop for Running<'_> {
    /// The task's bounds as they are now become bounds of an ended task. A task that
    /// failed leaves them too: a bound from the rows some run of a task saw holds for the
    /// output that any run of it makes (see the module doc).
    fn drop(&mut self) {
        let filters = {
            let mut inner = self.bounds.inner.lock().unwrap();
            let Some(filters) = self.key.and_then(|key| inner.running.remove(&key)) else {
                return;
            };
            inner.version += 1;
            filters
        };
        self.bounds
            .add(filters.into_iter().filter_map(|(filter, own)| {
                Some(MadeBound {
                    filter,
                    columns: own.children().into_iter().cloned().collect(),
                    value: own.snapshot().ok()??,
                })
            }));
    }
}

/// `bounds` as one predicate: their conjunction (`None` for none).
fn conjunction(bounds: &[Arc<dyn PhysicalExpr>]) -> Option<Arc<dyn PhysicalExpr>> {
    bounds
        .iter()
        .cloned()
        .reduce(|a, b| Arc::new(BinaryExpr::new(a, Operator::And, b)) as Arc<dyn PhysicalExpr>)
}

fn is_true(expr: &Arc<dyn PhysicalExpr>) -> bool {
    expr.downcast_ref::<Literal>()
        .is_some_and(|l| l.value() == &ScalarValue::Boolean(Some(true)))
}

/// `a` and `b` merged into one bound, where they are the same expression but for the
/// literals they compare to with `<` or `>` under ANDs and ORs (the smaller or the larger of
/// each pair is kept); `None` where they differ otherwise. For the shapes DataFusion's
/// aggregates and TopK sorts make (one `<` or `>` per aggregate or sort key, a sort key's
/// `=` before the next key's) that is the bound of both tasks' rows together.
fn merged(a: &Arc<dyn PhysicalExpr>, b: &Arc<dyn PhysicalExpr>) -> Option<Arc<dyn PhysicalExpr>> {
    if let (Some(x), Some(y)) = (
        a.downcast_ref::<BinaryExpr>(),
        b.downcast_ref::<BinaryExpr>(),
    ) {
        if x.op() != y.op() {
            return None;
        }
        // A comparison with a literal: keep the tighter literal.
        if let (Some(lx), Some(ly)) = (
            x.right().downcast_ref::<Literal>(),
            y.right().downcast_ref::<Literal>(),
        ) && matches!(x.op(), Operator::Lt | Operator::Gt)
            && x.left().as_ref() == y.left().as_ref()
        {
            let (vx, vy) = (lx.value(), ly.value());
            if vx.is_null() || vy.is_null() || vx.data_type() != vy.data_type() {
                return (vx == vy).then(|| Arc::clone(a));
            }
            let x_is_tighter = match x.op() {
                Operator::Lt => vx <= vy,
                _ => vx >= vy,
            };
            return Some(if x_is_tighter {
                Arc::clone(a)
            } else {
                Arc::clone(b)
            });
        }
        // Only through AND and OR: under any other operator (`(x < 5) = false`) a tighter
        // literal could make the whole looser or tighter.
        if matches!(x.op(), Operator::And | Operator::Or) {
            let left = merged(x.left(), y.left())?;
            let right = merged(x.right(), y.right())?;
            return Some(Arc::new(BinaryExpr::new(left, *x.op(), right)));
        }
    }
    // Anything else merges only with itself.
    (a.as_ref() == b.as_ref()).then(|| Arc::clone(a))
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::physical_expr::expressions::{Column, is_null};

    fn x() -> Arc<dyn PhysicalExpr> {
        Arc::new(Column::new("x", 0))
    }

    fn y() -> Arc<dyn PhysicalExpr> {
        Arc::new(Column::new("y", 1))
    }

    fn cmp(c: Arc<dyn PhysicalExpr>, op: Operator, v: i64) -> Arc<dyn PhysicalExpr> {
        Arc::new(BinaryExpr::new(c, op, lit(v)))
    }

    fn or(a: Arc<dyn PhysicalExpr>, b: Arc<dyn PhysicalExpr>) -> Arc<dyn PhysicalExpr> {
        Arc::new(BinaryExpr::new(a, Operator::Or, b))
    }

    fn and(a: Arc<dyn PhysicalExpr>, b: Arc<dyn PhysicalExpr>) -> Arc<dyn PhysicalExpr> {
        Arc::new(BinaryExpr::new(a, Operator::And, b))
    }

    fn shown(bounds: &BoundsMade, id: u64) -> String {
        let launch = bounds.at_launch();
        let Some(fixed) = launch.get(&id) else {
            return "none".into();
        };
        fixed.snapshot().unwrap().unwrap().to_string()
    }

    /// A bound of filter `filter`, on columns `x` and `y`.
    fn made(filter: u64, value: Arc<dyn PhysicalExpr>) -> MadeBound {
        MadeBound {
            filter,
            columns: vec![x(), y()],
            value,
        }
    }

    #[test]
    fn bounds_of_one_shape_merge_into_the_tightest() {
        let bounds = BoundsMade::default();
        bounds.add([made(1, cmp(x(), Operator::Lt, 10))]);
        bounds.add([made(1, cmp(x(), Operator::Lt, 7)), made(2, lit(true))]);
        bounds.add([made(1, cmp(x(), Operator::Lt, 9))]);
        assert_eq!(shown(&bounds, 1), "x@0 < 7");
        assert_eq!(shown(&bounds, 2), "none", "a task with no bound adds none");
        // min(x), max(y) of an aggregate: each side keeps its own tightest literal.
        bounds.add([made(
            3,
            or(cmp(x(), Operator::Lt, 5), cmp(y(), Operator::Gt, 50)),
        )]);
        bounds.add([made(
            3,
            or(cmp(x(), Operator::Lt, 8), cmp(y(), Operator::Gt, 90)),
        )]);
        assert_eq!(shown(&bounds, 3), "x@0 < 5 OR y@1 > 90");
        // A TopK's `x IS NULL OR x < t` (nulls first).
        let nulls_first = |t| or(is_null(x()).unwrap(), cmp(x(), Operator::Lt, t));
        bounds.add([made(4, nulls_first(20)), made(4, nulls_first(12))]);
        assert_eq!(shown(&bounds, 4), "x@0 IS NULL OR x@0 < 12");
    }

    #[test]
    fn bounds_of_other_shapes_are_a_conjunction_of_the_newest() {
        // A TopK over (x, y): `x > a OR x = a AND y > b`; `a` differs, so no merge.
        let two_keys = |a, b| {
            or(
                cmp(x(), Operator::Gt, a),
                and(cmp(x(), Operator::Eq, a), cmp(y(), Operator::Gt, b)),
            )
        };
        let bounds = BoundsMade::default();
        bounds.add([made(1, two_keys(3, 4))]);
        bounds.add([made(1, two_keys(5, 1))]);
        assert_eq!(
            shown(&bounds, 1),
            "(x@0 > 3 OR x@0 = 3 AND y@1 > 4) AND (x@0 > 5 OR x@0 = 5 AND y@1 > 1)"
        );
        // The same `a`: the tighter `b` wins in place.
        bounds.add([made(1, two_keys(5, 2))]);
        assert_eq!(
            shown(&bounds, 1),
            "(x@0 > 3 OR x@0 = 3 AND y@1 > 4) AND (x@0 > 5 OR x@0 = 5 AND y@1 > 2)"
        );
        for a in 10..20 {
            bounds.add([made(1, two_keys(a, 0))]);
        }
        let kept = shown(&bounds, 1);
        assert_eq!(kept.matches(" AND (").count() + 1, MAX_CONJUNCTS, "{kept}");
        assert!(kept.contains("x@0 > 19"), "the newest is kept: {kept}");
    }
}
