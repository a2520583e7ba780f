//! A test of probe keys against a build side's key set, carried through a task plan whole.
//!
//! [`KeysInSet`] ([`crate::plan::key_membership`]) is flumen's own expression, which
//! datafusion-proto does not know. It is sent as a flumen expression ([`KEYS_IN_SET`])
//! holding the set's bits, with the probe keys as its inputs.

use std::sync::Arc;

use datafusion::error::Result;
use datafusion::physical_plan::PhysicalExpr;
use prost::Message;

use crate::plan::key_membership::{KeyMembership, KeysInSet};

/// What a flumen expression in a task plan is: a test of keys against a key set.
pub const KEYS_IN_SET: &str = "flumen.keys_in_set";

/// A [`KEYS_IN_SET`] expression: the set's bits.
#[derive(Clone, PartialEq, prost::Message)]
struct KeysInSetNode {
    /// Always [`KEYS_IN_SET`].
    #[prost(string, tag = "1")]
    kind: String,
    /// [`KeyMembership::to_bytes`].
    #[prost(bytes = "vec", tag = "2")]
    set: Vec<u8>,
}

/// The bytes of `expr` as a [`KEYS_IN_SET`] expression when it is one, else `None`. Its
/// inputs are its children (the keys).
pub(super) fn encode(expr: &Arc<dyn PhysicalExpr>) -> Option<Vec<u8>> {
    let test = expr.downcast_ref::<KeysInSet>()?;
    let node = KeysInSetNode {
        kind: KEYS_IN_SET.into(),
        set: test.set().to_bytes(),
    };
    Some(node.encode_to_vec())
}

/// The test a [`KEYS_IN_SET`] expression holds, of `inputs` (the keys), or `None` when
/// `bytes` are not one.
pub(super) fn decode(
    bytes: &[u8],
    inputs: &[Arc<dyn PhysicalExpr>],
) -> Result<Option<Arc<dyn PhysicalExpr>>> {
    let Some(node) = KeysInSetNode::decode(bytes)
        .ok()
        .filter(|n| n.kind == KEYS_IN_SET)
    else {
        return Ok(None);
    };
    let set = Arc::new(KeyMembership::from_bytes(&node.set)?);
    Ok(Some(Arc::new(KeysInSet::new(inputs.to_vec(), set))))
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::physical_expr::expressions::Column;

    #[test]
    fn a_key_set_test_comes_back_with_its_bits() {
        let mut set = KeyMembership::new(1 << 16);
        set.insert([7, 1 << 40, 12_345_678_901]);
        let keys: Vec<Arc<dyn PhysicalExpr>> =
            vec![Arc::new(Column::new("a", 0)), Arc::new(Column::new("b", 3))];
        let test: Arc<dyn PhysicalExpr> = Arc::new(KeysInSet::new(keys.clone(), Arc::new(set)));
        let bytes = encode(&test).expect("a key set test");
        let back = decode(&bytes, &keys).unwrap().unwrap();
        assert_eq!(&back, &test);
        assert!(decode(b"not one", &keys).unwrap().is_none());
    }
}
