//! Cutting SQL text into statements at top-level `;`, outside quotes and comments, and a
//! script's lines into those statements and the shell's `\` commands.

/// Where a scan of SQL text stands: inside a quote, a comment, or neither.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lexer {
    Code,
    Quote(char),
    LineComment,
    BlockComment,
}

/// The statements of `script`, each without its `;`, and its shell commands: a line that
/// starts with `\` where a statement would start (`\d`, `\format csv`) is one, as in the
/// REPL. Text after the last `;` is returned as a statement too when it holds more than
/// whitespace and comments.
pub fn split(script: &str) -> Vec<String> {
    let mut items = vec![];
    let mut buffer = String::new();
    for line in script.lines() {
        if at_statement_start(&buffer) && line.trim_start().starts_with('\\') {
            buffer.clear();
            items.push(line.trim().to_string());
            continue;
        }
        buffer.push_str(line);
        buffer.push('\n');
        let (complete, rest) = split_complete(&buffer);
        items.extend(complete);
        buffer = rest;
    }
    if has_code(&buffer) {
        items.push(buffer.trim().to_string());
    }
    items
}

/// Whether `text` (lines read so far) ends where a statement would start: it holds only
/// whitespace and closed comments. (Text that ends inside a `/*` comment swallows whatever
/// follows it.)
fn at_statement_start(text: &str) -> bool {
    !has_code(text) && has_code(&format!("{text}x"))
}

/// The complete (`;`-terminated) statements of `text`, and the unfinished rest.
pub fn split_complete(text: &str) -> (Vec<String>, String) {
    let mut statements = vec![];
    let mut current = String::new();
    let mut state = Lexer::Code;
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match state {
            Lexer::Code => match c {
                ';' => {
                    if has_code(&current) {
                        statements.push(current.trim().to_string());
                    }
                    current.clear();
                    continue;
                }
                '\'' | '"' => state = Lexer::Quote(c),
                '-' if chars.peek() == Some(&'-') => state = Lexer::LineComment,
                '/' if chars.peek() == Some(&'*') => state = Lexer::BlockComment,
                _ => {}
            },
            Lexer::Quote(q) if c == q => state = Lexer::Code,
            Lexer::LineComment if c == '\n' => state = Lexer::Code,
            Lexer::BlockComment if c == '*' && chars.peek() == Some(&'/') => {
                current.push(c);
                current.push(chars.next().expect("peeked"));
                state = Lexer::Code;
                continue;
            }
            _ => {}
        }
        current.push(c);
    }
    (statements, current)
}

/// True when `text` holds something besides whitespace and comments.
pub fn has_code(text: &str) -> bool {
    let mut rest = text.trim_start();
    loop {
        if let Some(after) = rest.strip_prefix("--") {
            rest = after.split_once('\n').map_or("", |(_, r)| r).trim_start();
        } else if let Some(after) = rest.strip_prefix("/*") {
            rest = after.split_once("*/").map_or("", |(_, r)| r).trim_start();
        } else {
            return !rest.is_empty();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_outside_quotes_and_comments() {
        assert_eq!(
            split("SELECT ';'; -- a; comment\nSELECT 2 /* ; */; SELECT \"a;b\""),
            vec![
                "SELECT ';'",
                "-- a; comment\nSELECT 2 /* ; */",
                "SELECT \"a;b\""
            ]
        );
        assert_eq!(split("  ; -- only a comment\n"), Vec::<String>::new());
    }

    #[test]
    fn a_line_of_a_shell_command_is_one_where_a_statement_would_start() {
        assert_eq!(
            split(
                "CREATE TABLE t AS VALUES (1);\n\\d\n  \\d t\nSELECT\n'\\d'\n;\n\\format csv\nSELECT 2"
            ),
            vec![
                "CREATE TABLE t AS VALUES (1)",
                "\\d",
                "\\d t",
                "SELECT\n'\\d'",
                "\\format csv",
                "SELECT 2"
            ]
        );
        // Inside a statement or a comment, a line that starts with `\` is theirs.
        assert_eq!(split("SELECT '\n\\d'"), vec!["SELECT '\n\\d'"]);
        assert_eq!(split("/*\n\\d\n*/ SELECT 1"), vec!["/*\n\\d\n*/ SELECT 1"]);
    }

    #[test]
    fn an_unfinished_statement_is_the_rest() {
        let (done, rest) = split_complete("SELECT 1; SELECT\n  2");
        assert_eq!(done, vec!["SELECT 1"]);
        assert_eq!(rest.trim(), "SELECT\n  2");
        let (done, rest) = split_complete("SELECT 'it''s;");
        assert!(done.is_empty());
        assert!(has_code(&rest));
    }
}
