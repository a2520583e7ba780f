//! A join's build keys carried to the worker that runs a task of its build producer, and the
//! summary of the task's output keys carried back with the task's end
//! ([`crate::plan::build_keys`]).
//!
//! The keys go as datafusion-proto `PhysicalExprNode`s over the task plan's output columns;
//! each value of the summary as a datafusion-proto `ScalarValue`, a key's list as one list
//! value (its values in an Arrow array); the keys' set as base64 of its bits.

use std::collections::HashSet;
use std::sync::Arc;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use datafusion::arrow::array::Array;
use datafusion::arrow::datatypes::Schema;
use datafusion::common::ScalarValue;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::TaskContext;
use datafusion::physical_plan::PhysicalExpr;
use datafusion_proto::physical_plan::DefaultPhysicalExtensionCodec;
use datafusion_proto::physical_plan::from_proto::parse_physical_expr;
use datafusion_proto::physical_plan::to_proto::serialize_physical_expr;
use datafusion_proto::protobuf;
use prost::Message;
use serde::{Deserialize, Serialize};

use crate::plan::build_keys::{KeyRange, KeySummary};
use crate::plan::key_membership::KeyMembership;

/// A task's summary of its output keys, as it travels.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SentKeys {
    /// One per key, in the order the task was given them.
    pub keys: Vec<SentKeyRange>,
    /// The set of the keys ([`KeyMembership::to_bytes`], base64); `None`: none was made.
    #[serde(default)]
    pub membership: Option<String>,
}

/// One key's range and list, as they travel.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SentKeyRange {
    /// The least value (`None`: no value seen).
    pub min: Option<Vec<u8>>,
    /// The greatest value.
    pub max: Option<Vec<u8>>,
    /// Every distinct value, as one list value; `None`: too many to list.
    pub values: Option<Vec<u8>>,
}

/// `keys` as the bytes a task request carries.
pub fn encode_keys(keys: &[Arc<dyn PhysicalExpr>]) -> Result<Vec<Vec<u8>>> {
    keys.iter()
        .map(|key| {
            let node = serialize_physical_expr(key, &DefaultPhysicalExtensionCodec {})?;
            Ok(node.encode_to_vec())
        })
        .collect()
}

/// The keys a task request carries, over `schema` (the task plan's output).
pub fn decode_keys(
    keys: &[Vec<u8>],
    schema: &Schema,
    ctx: &TaskContext,
) -> Result<Vec<Arc<dyn PhysicalExpr>>> {
    keys.iter()
        .map(|bytes| {
            let node = protobuf::PhysicalExprNode::decode(bytes.as_slice()).map_err(|e| {
                DataFusionError::Execution(format!("a build key that does not decode: {e}"))
            })?;
            parse_physical_expr(&node, ctx, schema, &DefaultPhysicalExtensionCodec {})
        })
        .collect()
}

fn scalar_bytes(value: &ScalarValue) -> Result<Vec<u8>> {
    let value = protobuf::ScalarValue::try_from(value).map_err(|e| {
        DataFusionError::Execution(format!("a key value that does not encode: {e}"))
    })?;
    Ok(value.encode_to_vec())
}

fn scalar_of(bytes: &[u8]) -> Result<ScalarValue> {
    let bad =
        |e: String| DataFusionError::Execution(format!("a key value that does not decode: {e}"));
    let value = protobuf::ScalarValue::decode(bytes).map_err(|e| bad(e.to_string()))?;
    ScalarValue::try_from(&value).map_err(|e| bad(e.to_string()))
}

impl SentKeys {
    /// `summary` as it travels.
    pub fn of(summary: &KeySummary) -> Result<SentKeys> {
        let keys = (summary.keys.iter())
            .map(|range| {
                let values = match &range.values {
                    Some(listed) => {
                        let listed: Vec<ScalarValue> = listed.iter().cloned().collect();
                        let data_type = match (listed.first(), &range.min) {
                            (Some(v), _) | (None, Some(v)) => v.data_type(),
                            (None, None) => datafusion::arrow::datatypes::DataType::Null,
                        };
                        let list = ScalarValue::new_list_nullable(&listed, &data_type);
                        Some(scalar_bytes(&ScalarValue::List(list))?)
                    }
                    None => None,
                };
                Ok(SentKeyRange {
                    min: range.min.as_ref().map(scalar_bytes).transpose()?,
                    max: range.max.as_ref().map(scalar_bytes).transpose()?,
                    values,
                })
            })
            .collect::<Result<_>>()?;
        let membership = (summary.membership.as_ref()).map(|set| BASE64.encode(set.to_bytes()));
        Ok(SentKeys { keys, membership })
    }

    /// The summary it carries.
    pub fn summary(&self) -> Result<KeySummary> {
        let keys = (self.keys.iter())
            .map(|sent| {
                let values = match &sent.values {
                    Some(bytes) => {
                        let ScalarValue::List(list) = scalar_of(bytes)? else {
                            return Err(DataFusionError::Execution(
                                "a key list that is not a list".into(),
                            ));
                        };
                        let array = list.value(0);
                        let mut listed = HashSet::with_capacity(array.len());
                        for row in 0..array.len() {
                            listed.insert(ScalarValue::try_from_array(&array, row)?);
                        }
                        Some(listed)
                    }
                    None => None,
                };
                Ok(KeyRange {
                    min: sent.min.as_deref().map(scalar_of).transpose()?,
                    max: sent.max.as_deref().map(scalar_of).transpose()?,
                    values,
                })
            })
            .collect::<Result<_>>()?;
        let membership = match &self.membership {
            Some(text) => {
                let bytes = BASE64.decode(text).map_err(|e| {
                    DataFusionError::Execution(format!("a key set that does not decode: {e}"))
                })?;
                Some(KeyMembership::from_bytes(&bytes)?)
            }
            None => None,
        };
        Ok(KeySummary { keys, membership })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::array::{Date32Array, StringArray};
    use datafusion::arrow::datatypes::{DataType, Field};
    use datafusion::arrow::record_batch::RecordBatch;
    use datafusion::physical_expr::expressions::col;

    use crate::plan::build_keys::KeySummer;

    #[test]
    fn a_summary_and_its_keys_travel_unchanged() {
        let schema = Schema::new(vec![
            Field::new("name", DataType::Utf8, true),
            Field::new("day", DataType::Date32, true),
        ]);
        let keys = [col("name", &schema).unwrap(), col("day", &schema).unwrap()];
        let ctx = TaskContext::default();
        let decoded = decode_keys(&encode_keys(&keys).unwrap(), &schema, &ctx).unwrap();
        assert_eq!(
            decoded.iter().map(|k| k.to_string()).collect::<Vec<_>>(),
            ["name@0", "day@1"]
        );
        let batch = RecordBatch::try_new(
            Arc::new(schema.clone()),
            vec![
                Arc::new(StringArray::from(vec![Some("b"), None, Some("a")])),
                Arc::new(Date32Array::from(vec![Some(19000), Some(18000), None])),
            ],
        )
        .unwrap();
        let mut summer = KeySummer::new(decoded, &schema, 3).unwrap();
        summer.observe(&batch).unwrap();
        let summary = summer.finish().unwrap();
        let sent = SentKeys::of(&summary).unwrap();
        let json = serde_json::to_vec(&sent).unwrap();
        let back: SentKeys = serde_json::from_slice(&json).unwrap();
        assert_eq!(back.summary().unwrap(), summary);
        // Two rows with both keys: a set of the smallest size, holding them.
        let set = summary.membership.as_ref().unwrap();
        assert_eq!(set.bits(), crate::plan::key_membership::MIN_BITS);
        assert!(!set.is_empty());
        // A worker of an earlier build sends no set: not known, not empty.
        let older: SentKeys =
            serde_json::from_str(r#"{"keys":[{"min":null,"max":null,"values":null}]}"#).unwrap();
        assert_eq!(older.summary().unwrap().membership, None);
        // No row seen: no range, an empty list.
        let nothing = KeySummary::new(1);
        assert_eq!(SentKeys::of(&nothing).unwrap().summary().unwrap(), nothing);
    }
}
