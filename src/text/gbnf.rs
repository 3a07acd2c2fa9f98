//! GBNF (llama.cpp's grammar format, what llama-server's `grammar` field takes) to the Lark
//! syntax of llguidance, which compiles our constraints (`crate::text::constrain`).
//!
//! Hand-written (a documented exception to using crates): no Rust crate converts GBNF, and
//! llguidance's own converter is Python. The two syntaxes are close, so this is a token-level
//! rewrite, not a second grammar engine: `name ::= body` becomes `name: body` (`root` is
//! `start`; names lowercased with `-` as `_`), strings are re-quoted, a character class
//! `[...]` becomes the regex `/[...]/`, `.` any character, and the operators (`|`, `( )`, `*`,
//! `+`, `?`, `{m,n}`) and token references (`<[id]>`) stay. What llguidance then rejects is
//! the request's error, as any bad grammar.
use std::collections::HashMap;

/// Whether `g` is GBNF rather than Lark: a line opens with a rule's name and `::=`.
pub fn is_gbnf(g: &str) -> bool {
    g.lines().any(|l| {
        let l = l.trim_start();
        let name = l.find(|c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '_'));
        name.is_some_and(|n| n > 0 && l[n..].trim_start().starts_with("::="))
    })
}

/// One piece of GBNF text.
#[derive(Debug, Clone, PartialEq)]
enum Tok {
    /// A rule's name; `true` where it defines the rule (`name ::=`).
    Name(String, bool),
    /// A string literal's text (escapes decoded).
    Str(String),
    /// A character class, as the regex class it becomes (brackets included).
    Class(String),
    Any,
    /// An operator or a token reference, as written.
    Op(String),
}

/// The Lark grammar of the GBNF grammar `src`, or what is wrong with it.
pub fn to_lark(src: &str) -> Result<String, String> {
    let toks = tokens(src)?;
    let mut names: HashMap<String, String> = HashMap::new();
    for t in &toks {
        if let Tok::Name(n, true) = t {
            let lark = lark_name(n, &names);
            names.entry(n.clone()).or_insert(lark);
        }
    }
    if !names.contains_key("root") {
        return Err("a GBNF grammar defines `root ::= ...`".into());
    }
    let mut out = String::new();
    for t in toks {
        match t {
            Tok::Name(n, true) => {
                if !out.is_empty() {
                    out.push('\n');
                }
                out += &format!("{}:", names[&n]);
            }
            Tok::Name(n, false) => {
                let l = names
                    .get(&n)
                    .ok_or_else(|| format!("rule `{n}` is used, never defined"))?;
                out += &format!(" {l}");
            }
            Tok::Str(s) => out += &format!(" {}", serde_json::to_string(&s).unwrap_or_default()),
            Tok::Class(c) => out += &format!(" /{c}/"),
            Tok::Any => out += " /(?s:.)/",
            Tok::Op(o) => out += &format!(" {o}"),
        }
    }
    out.push('\n');
    Ok(out)
}

/// `name` as a Lark rule name (lowercase, `_` for `-`; `root` is `start`), distinct from the
/// names already given.
fn lark_name(name: &str, given: &HashMap<String, String>) -> String {
    if name == "root" {
        return "start".into();
    }
    let base = name.to_lowercase().replace('-', "_");
    let base = match base.as_str() {
        "start" => "start_".to_string(),
        _ => base,
    };
    let taken = |c: &str| given.values().any(|v| v == c);
    let mut cand = base.clone();
    let mut i = 2;
    while taken(&cand) {
        cand = format!("{base}_{i}");
        i += 1;
    }
    cand
}

fn tokens(src: &str) -> Result<Vec<Tok>, String> {
    let c: Vec<char> = src.chars().collect();
    let (mut i, mut out) = (0, Vec::new());
    while i < c.len() {
        let ch = c[i];
        match ch {
            '#' => {
                while i < c.len() && c[i] != '\n' {
                    i += 1;
                }
            }
            _ if ch.is_whitespace() => i += 1,
            '"' => {
                let (s, next) = string(&c, i + 1)?;
                out.push(Tok::Str(s));
                i = next;
            }
            '[' => {
                let (cls, next) = class(&c, i + 1)?;
                out.push(Tok::Class(cls));
                i = next;
            }
            '.' => {
                out.push(Tok::Any);
                i += 1;
            }
            '|' | '(' | ')' | '*' | '+' | '?' => {
                out.push(Tok::Op(ch.to_string()));
                i += 1;
            }
            '{' | '<' => {
                let close = if ch == '{' { '}' } else { '>' };
                let end = (i..c.len())
                    .find(|&j| c[j] == close)
                    .ok_or("an unclosed `{` or `<`")?;
                out.push(Tok::Op(c[i..=end].iter().collect()));
                i = end + 1;
            }
            _ if ch.is_ascii_alphanumeric() || ch == '-' || ch == '_' => {
                let start = i;
                while i < c.len() && (c[i].is_ascii_alphanumeric() || c[i] == '-' || c[i] == '_') {
                    i += 1;
                }
                let name: String = c[start..i].iter().collect();
                let mut j = i;
                while j < c.len() && (c[j] == ' ' || c[j] == '\t') {
                    j += 1;
                }
                let defines = c[j..].starts_with(&[':', ':', '=']);
                if defines {
                    i = j + 3;
                }
                out.push(Tok::Name(name, defines));
            }
            _ => return Err(format!("unexpected {ch:?} in the GBNF grammar")),
        }
    }
    Ok(out)
}

/// One escape after `\` at `c[i]`: the character, and where the text goes on.
fn escape(c: &[char], i: usize) -> Result<(char, usize), String> {
    let hex = |n: usize| -> Result<(char, usize), String> {
        let h: String = c
            .get(i + 1..i + 1 + n)
            .ok_or("a short escape")?
            .iter()
            .collect();
        let v = u32::from_str_radix(&h, 16).map_err(|_| format!("a bad escape \\{}{h}", c[i]))?;
        Ok((
            char::from_u32(v).ok_or("an escape past Unicode")?,
            i + 1 + n,
        ))
    };
    match c.get(i).ok_or("a `\\` at the end")? {
        'n' => Ok(('\n', i + 1)),
        't' => Ok(('\t', i + 1)),
        'r' => Ok(('\r', i + 1)),
        'x' => hex(2),
        'u' => hex(4),
        'U' => hex(8),
        &other => Ok((other, i + 1)),
    }
}

/// A string literal from `c[i]` (after its `"`): its text, and where the grammar goes on.
fn string(c: &[char], mut i: usize) -> Result<(String, usize), String> {
    let mut s = String::new();
    loop {
        match c.get(i).ok_or("an unclosed string")? {
            '"' => return Ok((s, i + 1)),
            '\\' => {
                let (ch, next) = escape(c, i + 1)?;
                s.push(ch);
                i = next;
            }
            &ch => {
                s.push(ch);
                i += 1;
            }
        }
    }
}

/// A character class from `c[i]` (after its `[`) as a regex class, and where the grammar goes
/// on. Its characters are escaped where a regex class would read them otherwise (`[`, `/`,
/// `&`, `~`, a `-` that is not a range).
fn class(c: &[char], mut i: usize) -> Result<(String, usize), String> {
    let mut out = String::from("[");
    if c.get(i) == Some(&'^') {
        out.push('^');
        i += 1;
    }
    let mut first = true;
    loop {
        let ch = *c.get(i).ok_or("an unclosed character class")?;
        if ch == ']' && !first {
            out.push(']');
            return Ok((out, i + 1));
        }
        first = false;
        let (lit, next) = match ch {
            '\\' => escape(c, i + 1)?,
            _ => (ch, i + 1),
        };
        let range = ch != '\\' && lit == '-' && out.len() > 1 && c.get(next) != Some(&']');
        match lit {
            '-' if range => out.push('-'),
            '\n' => out += "\\n",
            '\t' => out += "\\t",
            '\r' => out += "\\r",
            _ if lit.is_ascii_punctuation() => out += &format!("\\{lit}"),
            _ if lit.is_control() => out += &format!("\\x{{{:x}}}", lit as u32),
            _ => out.push(lit),
        }
        i = next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gbnf_rules_become_lark_rules() {
        let g = r#"
# yes or no, then a number
root ::= answer " " num
answer ::= "yes" | "no"
num ::= [0-9]+ ("." [0-9]{1,3})?
"#;
        assert!(is_gbnf(g) && !is_gbnf("start: \"a ::= b\" // x ::= y"));
        let l = to_lark(g).unwrap();
        assert_eq!(
            l,
            "start: answer \" \" num\nanswer: \"yes\" | \"no\"\nnum: /[0-9]/ + ( \".\" /[0-9]/ {1,3} ) ?\n"
        );
    }

    /// llama.cpp's grammars/json.gbnf (rules over several lines, an empty alternative,
    /// escapes in classes, bounded repeats).
    const JSON: &str = r#"root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws

object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws

array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]" ws

string ::=
  "\"" (
    [^"\\\x7F\x00-\x1F] |
    "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) # escapes
  )* "\"" ws

number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws

# Optional space: by convention, applied in this grammar after literal chars when allowed
ws ::= | " " | "\n" [ \t]{0,20}
"#;

    #[test]
    fn llama_cpps_json_grammar_converts() {
        let l = to_lark(JSON).unwrap();
        assert!(l.starts_with("start: object\nvalue: object | array"), "{l}");
        assert!(l.contains(r#"/[^\"\\\x{7f}\x{0}-\x{1f}]/"#), "{l}");
        assert!(
            l.ends_with("ws: | \" \" | \"\\n\" /[ \\t]/ {0,20}\n"),
            "{l}"
        );
    }

    #[test]
    fn names_strings_and_classes_are_rewritten() {
        let g = "root ::= my-rule Start\nmy-rule ::= \"a\\\"b\\n\\x41\" [^\"\\\\/\\]a-z-] .\nStart ::= <[42]>";
        let l = to_lark(g).unwrap();
        assert!(l.starts_with("start: my_rule start_\n"), "{l}");
        assert!(
            l.contains("my_rule: \"a\\\"b\\nA\" /[^\\\"\\\\\\/\\]a-z\\-]/ /(?s:.)/"),
            "{l}"
        );
        assert!(l.ends_with("start_: <[42]>\n"), "{l}");
        for bad in [
            "answer ::= \"x\"",
            "root ::= \"x",
            "root ::= [a-z",
            "root ::= other",
            "root ::= \"\\xZZ\"",
            "root ::= $",
        ] {
            assert!(to_lark(bad).is_err(), "{bad}");
        }
    }
}
