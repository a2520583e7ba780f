//! The interactive REPL: rustyline with a history file, statements over several lines up to
//! `;`, Ctrl-C to clear the line (or cancel a running query), Ctrl-D or `\q` to quit.

use std::path::PathBuf;

use rustyline::DefaultEditor;
use rustyline::error::ReadlineError;
use tokio::runtime::Runtime;

use crate::shell::{Flow, Shell};
use crate::statements;

/// Where the REPL keeps its history: the user's data dir.
fn history_path() -> Option<PathBuf> {
    dirs::data_dir().map(|d| d.join("flumen").join("history.txt"))
}

/// Read statements from the terminal until Ctrl-D or `\q`. Returns true when no statement
/// failed.
pub fn run(shell: &mut Shell, runtime: &Runtime) -> Result<bool, ReadlineError> {
    let mut editor = DefaultEditor::new()?;
    let history = history_path();
    if let Some(path) = &history {
        let _ = editor.load_history(path);
    }
    println!(
        "flumen {} on DataFusion {}: SQL statements end with ';', \\? for help, \\q to quit.",
        env!("CARGO_PKG_VERSION"),
        datafusion::DATAFUSION_VERSION
    );
    let mut all_ok = true;
    let mut buffer = String::new();
    loop {
        let prompt = if buffer.is_empty() {
            "flumen> "
        } else {
            "     -> "
        };
        match editor.readline(prompt) {
            Ok(line) => {
                if buffer.is_empty() && line.trim_start().starts_with('\\') {
                    let _ = editor.add_history_entry(line.trim());
                    match runtime.block_on(shell.run(&line)) {
                        Ok(Flow::Quit) => break,
                        Ok(Flow::Continue) => {}
                        Err(e) => {
                            eprintln!("Error: {e}");
                            all_ok = false;
                        }
                    }
                    continue;
                }
                buffer.push_str(&line);
                buffer.push('\n');
                let (complete, rest) = statements::split_complete(&buffer);
                if complete.is_empty() {
                    if !statements::has_code(&buffer) {
                        buffer.clear();
                    }
                    continue;
                }
                let _ = editor.add_history_entry(buffer.trim());
                for statement in complete {
                    if let Err(e) = runtime.block_on(shell.run(&statement)) {
                        eprintln!("Error: {e}");
                        all_ok = false;
                    }
                }
                buffer = if statements::has_code(&rest) {
                    rest
                } else {
                    String::new()
                };
            }
            Err(ReadlineError::Interrupted) => buffer.clear(),
            Err(ReadlineError::Eof) => break,
            Err(e) => return Err(e),
        }
    }
    if let Some(path) = &history {
        if let Some(dir) = path.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        if let Err(e) = editor.save_history(path) {
            eprintln!("could not save history to {}: {e}", path.display());
        }
    }
    Ok(all_ok)
}
