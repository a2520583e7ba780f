//! Accelerator UDFs: scalar functions that the planner puts in an operator of their own,
//! run on the accelerator pool.
//!
//! A function becomes an accelerator UDF by implementing [`AcceleratorFunction`] and being
//! wrapped with [`accelerator_udf`]; the planner recognises the wrapper type
//! ([`AcceleratorUdf`]) inside a `ProjectionExec` and cuts the projection out as an
//! accelerator operator.

use std::any::Any;
use std::fmt::Debug;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use datafusion::arrow::datatypes::DataType;
use datafusion::error::Result;
use datafusion::logical_expr::{
    ColumnarValue, ScalarFunctionArgs, ScalarUDF, ScalarUDFImpl, Signature,
};
use datafusion::physical_expr::ScalarFunctionExpr;
use datafusion::physical_plan::PhysicalExpr;

/// A model-backed (or otherwise expensive) scalar function that runs on the accelerator pool.
pub trait AcceleratorFunction: Debug + Send + Sync + 'static {
    /// SQL name of the function.
    fn name(&self) -> &str;
    /// Accepted argument types.
    fn signature(&self) -> &Signature;
    /// Result type for the given argument types.
    fn return_type(&self, arg_types: &[DataType]) -> Result<DataType>;
    /// Evaluate the function over one batch of rows.
    fn invoke_batch(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue>;
}

/// The `ScalarUDFImpl` wrapper that marks a function as an accelerator UDF.
#[derive(Debug)]
pub struct AcceleratorUdf {
    func: Arc<dyn AcceleratorFunction>,
}

impl AcceleratorUdf {
    /// The wrapped function.
    pub fn function(&self) -> &Arc<dyn AcceleratorFunction> {
        &self.func
    }
}

impl PartialEq for AcceleratorUdf {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.func, &other.func)
    }
}
impl Eq for AcceleratorUdf {}
impl Hash for AcceleratorUdf {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.func.name().hash(state);
    }
}

impl ScalarUDFImpl for AcceleratorUdf {
    fn name(&self) -> &str {
        self.func.name()
    }
    fn signature(&self) -> &Signature {
        self.func.signature()
    }
    fn return_type(&self, arg_types: &[DataType]) -> Result<DataType> {
        self.func.return_type(arg_types)
    }
    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        self.func.invoke_batch(args)
    }
}

/// Wrap an accelerator function as a `ScalarUDF` to register with `ctx.register_udf`.
pub fn accelerator_udf(func: impl AcceleratorFunction) -> ScalarUDF {
    ScalarUDF::new_from_impl(AcceleratorUdf {
        func: Arc::new(func),
    })
}

/// True when `udf` is an accelerator UDF.
pub fn is_accelerator_udf(udf: &ScalarUDF) -> bool {
    (udf.inner().as_ref() as &dyn Any).is::<AcceleratorUdf>()
}

/// True when the physical expression calls an accelerator UDF anywhere inside it.
pub fn calls_accelerator_udf(expr: &Arc<dyn PhysicalExpr>) -> bool {
    if let Some(call) = (expr.as_ref() as &dyn Any).downcast_ref::<ScalarFunctionExpr>()
        && is_accelerator_udf(call.fun())
    {
        return true;
    }
    expr.children().into_iter().any(calls_accelerator_udf)
}
