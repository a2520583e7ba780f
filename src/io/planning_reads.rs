//! Reads made while a statement is planned. DataFusion calls a table function synchronously,
//! perhaps on one of its runtime's threads, but what the function must read first (a Delta
//! log, a file's footer, a listing) is async: [`read_while_planning`] runs it to the end on
//! a thread of its own, on a runtime of its own, and hands back what it read.

use std::future::Future;

use datafusion::error::{DataFusionError, Result};

/// Run the future `read` makes on a thread of its own with a current-thread runtime, and
/// wait for its result. `what` names the read in the error if that thread panics.
pub(crate) fn read_while_planning<T, F, Fut>(what: &str, read: F) -> Result<T>
where
    T: Send,
    F: FnOnce() -> Fut + Send,
    Fut: Future<Output = Result<T>>,
{
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(|e| DataFusionError::Execution(format!("{what}: {e}")))?
                    .block_on(read())
            })
            .join()
            .unwrap_or_else(|_| Err(DataFusionError::Execution(format!("{what}: panicked"))))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_read_runs_to_its_end_and_its_error_comes_back() {
        let n = read_while_planning("a sum", || async { Ok(2 + 3) }).unwrap();
        assert_eq!(n, 5);
        let e = read_while_planning::<(), _, _>("a read", || async {
            Err(DataFusionError::Plan("no file".into()))
        })
        .unwrap_err();
        assert!(e.to_string().contains("no file"), "{e}");
    }

    #[tokio::test]
    async fn a_read_runs_inside_a_current_thread_runtime_too() {
        let n = read_while_planning("a sleep", || async {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            Ok(7)
        })
        .unwrap();
        assert_eq!(n, 7);
    }
}
