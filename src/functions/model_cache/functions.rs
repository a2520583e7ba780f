//! The cache's three steps as SQL functions, which the planner puts around a cacheable model
//! call ([`crate::plan::model_cache_lookup`]) and worker processes resolve by name:
//!
//! - `model_cache_key(identity, args...)`, in the CPU stage: each row's key
//!   ([`row_keys`]), a 32-byte binary.
//! - `model_cache_get(identity, key, typed_null)`, in the CPU stage: per row whether the
//!   cache has it and the cached output (`{found, value}`, [`hits_type`] of `typed_null`'s
//!   type, the model's result type): a cached null is a hit too.
//! - `model_cache_fill(identity, hit, key, computed)`, in the model operator: the cached
//!   value where the row was found, else `computed`; the computed rows are written to the
//!   cache.
//!
//! `identity` is the function's [`cache_identity`] when the query was planned; the cache's
//! place is the session's `flumen.model_cache`.
//!
//! [`cache_identity`]: crate::functions::accelerator::AcceleratorFunction::cache_identity

use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef, FixedSizeBinaryArray, UInt32Array};
use datafusion::arrow::compute::take;
use datafusion::arrow::datatypes::DataType;
use datafusion::common::ScalarValue;
use datafusion::error::{DataFusionError, Result};
use datafusion::logical_expr::{
    ColumnarValue, ScalarFunctionArgs, ScalarUDF, ScalarUDFImpl, Signature, Volatility,
};

use super::{CachedCall, Lookup, hits_type, identity_hash, merge_misses, miss_rows, row_keys};

/// Name of the key function.
pub const KEY: &str = "model_cache_key";
/// Name of the lookup function.
pub const GET: &str = "model_cache_get";
/// Name of the function that fills in misses and writes them.
pub const FILL: &str = "model_cache_fill";

/// The three functions, to register with a session.
pub fn model_cache_functions() -> Vec<ScalarUDF> {
    vec![
        ScalarUDF::new_from_impl(CacheKey {
            signature: Signature::variadic_any(Volatility::Immutable),
        }),
        ScalarUDF::new_from_impl(CacheGet {
            signature: Signature::any(3, Volatility::Volatile),
        }),
        ScalarUDF::new_from_impl(CacheFill {
            signature: Signature::any(4, Volatility::Volatile),
        }),
    ]
}

/// The identity a call names in its first argument (a string literal).
fn identity_of(args: &[ColumnarValue], function: &str) -> Result<String> {
    match args.first() {
        Some(ColumnarValue::Scalar(
            ScalarValue::Utf8(Some(identity))
            | ScalarValue::LargeUtf8(Some(identity))
            | ScalarValue::Utf8View(Some(identity)),
        )) => Ok(identity.clone()),
        _ => Err(DataFusionError::Plan(format!(
            "{function} takes a model's identity (a string literal) first"
        ))),
    }
}

/// The `n`th argument (after the identity) as an array of `rows` rows.
fn array_arg(args: &[ColumnarValue], n: usize, rows: usize, function: &str) -> Result<ArrayRef> {
    args.get(n)
        .ok_or_else(|| DataFusionError::Plan(format!("{function} takes {} arguments", n + 1)))?
        .to_array(rows)
}

#[derive(Debug, PartialEq, Eq, Hash)]
struct CacheKey {
    signature: Signature,
}

impl ScalarUDFImpl for CacheKey {
    fn name(&self) -> &str {
        KEY
    }
    fn signature(&self) -> &Signature {
        &self.signature
    }
    fn return_type(&self, _: &[DataType]) -> Result<DataType> {
        Ok(DataType::FixedSizeBinary(32))
    }
    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        let identity = identity_hash(&identity_of(&args.args, KEY)?);
        let rows = args.number_rows;
        let values = (args.args[1..].iter())
            .map(|a| a.to_array(rows))
            .collect::<Result<Vec<_>>>()?;
        let keys = row_keys(&identity, &values, rows)?;
        let keys = FixedSizeBinaryArray::try_from_iter(keys.iter())?;
        Ok(ColumnarValue::Array(Arc::new(keys)))
    }
}

#[derive(Debug, PartialEq, Eq, Hash)]
struct CacheGet {
    signature: Signature,
}

impl ScalarUDFImpl for CacheGet {
    fn name(&self) -> &str {
        GET
    }
    fn signature(&self) -> &Signature {
        &self.signature
    }
    fn return_type(&self, arg_types: &[DataType]) -> Result<DataType> {
        arg_types
            .get(2)
            .map(hits_type)
            .ok_or_else(|| DataFusionError::Plan(format!("{GET} takes 3 arguments")))
    }
    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        let identity = identity_of(&args.args, GET)?;
        let rows = args.number_rows;
        // The model's result type, which the third argument (a typed null) carries.
        let data_type = (args.arg_fields.get(2))
            .map(|f| f.data_type().clone())
            .ok_or_else(|| DataFusionError::Plan(format!("{GET} takes 3 arguments")))?;
        let Some(cache) = CachedCall::open_identity(&identity, &args.config_options)? else {
            // The cache was turned off since the query was planned: every row misses.
            let hits = Lookup::nothing_found(rows).hits(&data_type)?;
            return Ok(ColumnarValue::Array(hits));
        };
        let keys = array_arg(&args.args, 1, rows, GET)?;
        let keys = keys
            .as_any()
            .downcast_ref::<FixedSizeBinaryArray>()
            .ok_or_else(|| DataFusionError::Plan(format!("{GET} takes keys from {KEY}")))?;
        let keys: Vec<[u8; 32]> = (0..keys.len())
            .map(|row| keys.value(row).try_into())
            .collect::<std::result::Result<_, _>>()
            .map_err(|_| DataFusionError::Plan(format!("{GET} takes 32-byte keys")))?;
        let hits = cache.lookup(&keys).hits(&data_type)?;
        Ok(ColumnarValue::Array(hits))
    }
}

#[derive(Debug, PartialEq, Eq, Hash)]
struct CacheFill {
    signature: Signature,
}

impl ScalarUDFImpl for CacheFill {
    fn name(&self) -> &str {
        FILL
    }
    fn signature(&self) -> &Signature {
        &self.signature
    }
    fn return_type(&self, arg_types: &[DataType]) -> Result<DataType> {
        arg_types
            .get(3)
            .cloned()
            .ok_or_else(|| DataFusionError::Plan(format!("{FILL} takes 4 arguments")))
    }
    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        let identity = identity_of(&args.args, FILL)?;
        let rows = args.number_rows;
        let hits = array_arg(&args.args, 1, rows, FILL)?;
        let keys = array_arg(&args.args, 2, rows, FILL)?;
        let computed = array_arg(&args.args, 3, rows, FILL)?;
        // `computed` has a row per input row, null where a row hit; the cache wants one
        // per miss.
        let misses = UInt32Array::from(miss_rows(&hits)?);
        let computed = take(computed.as_ref(), &misses, None)?;
        fill(&identity, &args.config_options, &hits, &keys, &computed).map(ColumnarValue::Array)
    }
}

/// The model's output for rows whose lookup found `hits` ([`hits_type`]): the cached
/// values, and `computed` (one per miss) for the misses, written to the cache of the function
/// `identity` names when the session has one.
pub fn fill(
    identity: &str,
    config: &datafusion::config::ConfigOptions,
    hits: &ArrayRef,
    keys: &ArrayRef,
    computed: &ArrayRef,
) -> Result<ArrayRef> {
    match CachedCall::open_identity(identity, config)? {
        Some(cache) => cache.fill(hits, keys, computed),
        // The cache was turned off since the query was planned: nothing to write.
        None => merge_misses(hits, computed),
    }
}
