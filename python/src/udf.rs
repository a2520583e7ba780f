//! Python functions as CPU SQL functions: `Session.register_udf(name, function, returns)`.
//!
//! A function decorated with `@flumen.udf(returns=...)` runs in the CPU tasks that evaluate
//! its expression (the CPU pool), on whole batches: `function(batch)` gets a
//! `pyarrow.RecordBatch` of the call's arguments (`arg0`, `arg1`, ...) and returns one
//! value per row (anything with `__arrow_c_array__`). Each call takes the GIL while Python
//! runs, so Python functions in one process take turns. In worker mode they ship to the
//! CPU workers with the tasks that call them (`crate::shipping`).

use std::hash::{Hash, Hasher};

use datafusion::arrow::datatypes::DataType;
use datafusion::error::Result;
use datafusion::logical_expr::{
    ColumnarValue, ScalarFunctionArgs, ScalarUDFImpl, Signature, Volatility,
};
use pyo3::prelude::*;

use crate::model::{call_python, qualified_name};

/// A Python function registered as a SQL function.
#[derive(Debug)]
pub struct PythonUdf {
    name: String,
    function: Py<PyAny>,
    function_name: String,
    returns: DataType,
    signature: Signature,
    /// The function and its registration as `flumen._shipping.pack` made them, for worker
    /// processes (`None`: it cannot leave this process).
    packed: Option<Vec<u8>>,
}

impl PythonUdf {
    /// `function` as SQL function `name`, returning `returns`; `packed`: what ships to
    /// worker processes.
    pub fn new(
        py: Python<'_>,
        name: &str,
        function: Py<PyAny>,
        returns: DataType,
        packed: Option<Vec<u8>>,
    ) -> Self {
        let function_name = qualified_name(py, &function, name);
        Self {
            name: name.to_string(),
            function,
            function_name,
            returns,
            signature: Signature::variadic_any(Volatility::Volatile),
            packed,
        }
    }

    /// What ships to worker processes, when it can.
    pub fn packed(&self) -> Option<&Vec<u8>> {
        self.packed.as_ref()
    }
}

impl PartialEq for PythonUdf {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name && self.function.as_ptr() == other.function.as_ptr()
    }
}
impl Eq for PythonUdf {}
impl Hash for PythonUdf {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.name.hash(state);
    }
}

impl ScalarUDFImpl for PythonUdf {
    fn name(&self) -> &str {
        &self.name
    }
    fn signature(&self) -> &Signature {
        &self.signature
    }
    fn return_type(&self, _: &[DataType]) -> Result<DataType> {
        Ok(self.returns.clone())
    }
    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        let arrays = ColumnarValue::values_to_arrays(&args.args)?;
        let output = call_python(
            &self.function,
            &format!("Python function {}", self.function_name),
            &arrays,
            args.number_rows,
            args.return_field.data_type(),
        )?;
        Ok(ColumnarValue::Array(output))
    }
}
