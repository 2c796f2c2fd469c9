//! Which form of message content a chat template expects, detected from its syntax tree as
//! vLLM does (`_detect_content_format`): *openai* when the template loops over a message's
//! `content` (it reads a list of `{"type": "text", "text": …}` parts), else *string* (the
//! parts' texts are joined with `"\n"` before the template sees them).
//!
//! The rule, on the parsed template:
//! 1. the names bound to `messages`: `messages` itself and every `{% set x = … %}` whose value
//!    is one of those names (possibly sliced, filtered or tested), transitively;
//! 2. the loop variables of `{% for m in <one of them> %}`;
//! 3. *openai* if some loop iterates over `m.content` / `m['content']` of such a variable, over
//!    a macro parameter that a call fills with such a `content`, or (outside macros) over a
//!    variable named `content`.
//!
//! Invariant: a template the rule cannot read (it does not parse, or a name is bound by
//! something other than a plain variable) is *string*, vLLM's default.

use minijinja::machinery::ast::{CallArg, Expr, Stmt};
use minijinja::machinery::parse;
use minijinja::syntax::SyntaxConfig;

/// The content form a template expects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ContentFormat {
    /// Text parts joined into one string.
    String,
    /// A list of typed parts.
    OpenAi,
}

/// The content form `source` expects (see the module doc).
pub(crate) fn detect(source: &str) -> ContentFormat {
    let Ok(tree) = parse(source, "chat_template", SyntaxConfig::default()) else {
        return ContentFormat::String;
    };
    let mut nodes = Nodes::default();
    nodes.stmt(&tree, None);
    match nodes.loops_over_content() {
        Some(true) => ContentFormat::OpenAi,
        _ => ContentFormat::String,
    }
}

/// A `{% for %}` loop: its target, what it iterates, and the macro it is in.
struct Loop<'t, 's> {
    target: &'t Expr<'s>,
    iter: &'t Expr<'s>,
    in_macro: Option<usize>,
}

/// A macro definition: its name and parameter names (`None` when a parameter is not a plain
/// name).
struct MacroDef<'s> {
    name: &'s str,
    params: Vec<Option<&'s str>>,
}

/// The statements and expressions of a template that the rule reads.
#[derive(Default)]
struct Nodes<'t, 's> {
    sets: Vec<(&'t Expr<'s>, &'t Expr<'s>)>,
    loops: Vec<Loop<'t, 's>>,
    macros: Vec<MacroDef<'s>>,
    calls: Vec<(&'s str, &'t [CallArg<'s>])>,
}

impl<'t, 's> Nodes<'t, 's> {
    fn stmts(&mut self, stmts: &'t [Stmt<'s>], in_macro: Option<usize>) {
        for s in stmts {
            self.stmt(s, in_macro);
        }
    }

    fn stmt(&mut self, stmt: &'t Stmt<'s>, in_macro: Option<usize>) {
        match stmt {
            Stmt::Template(t) => self.stmts(&t.children, in_macro),
            Stmt::EmitExpr(e) => self.expr(&e.expr),
            Stmt::ForLoop(f) => {
                self.loops.push(Loop {
                    target: &f.target,
                    iter: &f.iter,
                    in_macro,
                });
                self.expr(&f.iter);
                if let Some(e) = &f.filter_expr {
                    self.expr(e);
                }
                self.stmts(&f.body, in_macro);
                self.stmts(&f.else_body, in_macro);
            }
            Stmt::IfCond(i) => {
                self.expr(&i.expr);
                self.stmts(&i.true_body, in_macro);
                self.stmts(&i.false_body, in_macro);
            }
            Stmt::WithBlock(w) => {
                for (_, value) in &w.assignments {
                    self.expr(value);
                }
                self.stmts(&w.body, in_macro);
            }
            Stmt::Set(s) => {
                self.sets.push((&s.target, &s.expr));
                self.expr(&s.expr);
            }
            Stmt::SetBlock(s) => self.stmts(&s.body, in_macro),
            Stmt::AutoEscape(a) => self.stmts(&a.body, in_macro),
            Stmt::FilterBlock(f) => self.stmts(&f.body, in_macro),
            Stmt::Block(b) => self.stmts(&b.body, in_macro),
            Stmt::Macro(m) => self.macro_def(m.name, &m.args, &m.body),
            Stmt::CallBlock(c) => {
                self.call(&c.call.expr, &c.call.args);
                let m = &c.macro_decl;
                self.macro_def(m.name, &m.args, &m.body);
            }
            Stmt::Do(d) => self.call(&d.call.expr, &d.call.args),
            _ => {}
        }
    }

    fn macro_def(&mut self, name: &'s str, args: &'t [Expr<'s>], body: &'t [Stmt<'s>]) {
        let index = self.macros.len();
        self.macros.push(MacroDef {
            name,
            params: args.iter().map(var_name).collect(),
        });
        self.stmts(body, Some(index));
    }

    fn call(&mut self, callee: &'t Expr<'s>, args: &'t [CallArg<'s>]) {
        if let Expr::Var(v) = callee {
            self.calls.push((v.id, args));
        }
        self.expr(callee);
        for a in args {
            match a {
                CallArg::Pos(e) | CallArg::Kwarg(_, e) | CallArg::PosSplat(e) => self.expr(e),
                CallArg::KwargSplat(e) => self.expr(e),
            }
        }
    }

    /// Finds the calls inside an expression (the only thing the rule needs from them).
    fn expr(&mut self, expr: &'t Expr<'s>) {
        match expr {
            Expr::Call(c) => self.call(&c.expr, &c.args),
            Expr::Slice(s) => {
                self.expr(&s.expr);
                for e in [&s.start, &s.stop, &s.step].into_iter().flatten() {
                    self.expr(e);
                }
            }
            Expr::UnaryOp(u) => self.expr(&u.expr),
            Expr::BinOp(b) => {
                self.expr(&b.left);
                self.expr(&b.right);
            }
            Expr::Compare(c) => {
                self.expr(&c.expr);
                for op in &c.ops {
                    self.expr(&op.expr);
                }
            }
            Expr::IfExpr(i) => {
                self.expr(&i.test_expr);
                self.expr(&i.true_expr);
                if let Some(e) = &i.false_expr {
                    self.expr(e);
                }
            }
            Expr::Filter(f) => {
                if let Some(e) = &f.expr {
                    self.expr(e);
                }
                self.args(&f.args);
            }
            Expr::Test(t) => {
                self.expr(&t.expr);
                self.args(&t.args);
            }
            Expr::GetAttr(g) => self.expr(&g.expr),
            Expr::GetItem(g) => {
                self.expr(&g.expr);
                self.expr(&g.subscript_expr);
            }
            Expr::List(l) => l.items.iter().for_each(|e| self.expr(e)),
            Expr::Tuple(t) => t.items.iter().for_each(|e| self.expr(e)),
            Expr::Map(m) => m.keys.iter().chain(&m.values).for_each(|e| self.expr(e)),
            Expr::Var(_) | Expr::Const(_) => {}
        }
    }

    fn args(&mut self, args: &'t [CallArg<'s>]) {
        for a in args {
            match a {
                CallArg::Pos(e) | CallArg::Kwarg(_, e) | CallArg::PosSplat(e) => self.expr(e),
                CallArg::KwargSplat(e) => self.expr(e),
            }
        }
    }

    /// Step 1: `messages` and the names bound to it; `None` if one is bound to a non-name.
    fn message_list_names(&self) -> Option<Vec<&'s str>> {
        let mut names = vec!["messages"];
        let mut i = 0;
        while i < names.len() {
            let related = names[i];
            for (target, value) in &self.sets {
                if access(value, related, None) {
                    let name = var_name(target)?;
                    if !names.contains(&name) {
                        names.push(name);
                    }
                }
            }
            i += 1;
        }
        Some(names)
    }

    /// Step 2: the loop variables over those names.
    fn message_names(&self) -> Option<Vec<&'s str>> {
        let lists = self.message_list_names()?;
        let mut out = Vec::new();
        for l in &self.loops {
            if lists.iter().any(|n| access(l.iter, n, None)) {
                out.push(var_name(l.target)?);
            }
        }
        Some(out)
    }

    /// Macro parameters that some call fills with a message's `content`.
    fn content_params(&self, messages: &[&'s str]) -> Vec<Vec<&'s str>> {
        let is_content = |e: &Expr<'s>| messages.iter().any(|m| access(e, m, Some("content")));
        self.macros
            .iter()
            .map(|m| {
                let mut params = Vec::new();
                for (callee, args) in &self.calls {
                    if *callee != m.name {
                        continue;
                    }
                    let positional = args.iter().filter_map(|a| match a {
                        CallArg::Pos(e) => Some(e),
                        _ => None,
                    });
                    for (i, e) in positional.enumerate() {
                        if let Some(Some(p)) = m.params.get(i).filter(|_| is_content(e)) {
                            params.push(*p);
                        }
                    }
                    for a in args.iter() {
                        if let CallArg::Kwarg(key, e) = a {
                            if m.params.contains(&Some(*key)) && is_content(e) {
                                params.push(*key);
                            }
                        }
                    }
                }
                params
            })
            .collect()
    }

    /// Step 3: whether some loop iterates over message content; `None` when the rule cannot
    /// read the template.
    fn loops_over_content(&self) -> Option<bool> {
        let messages = self.message_names()?;
        let params = self.content_params(&messages);
        for l in &self.loops {
            if messages.iter().any(|m| access(l.iter, m, Some("content"))) {
                var_name(l.target)?;
                return Some(true);
            }
            let iter_name = match l.iter {
                Expr::Var(v) => Some(v.id),
                _ => None,
            };
            let Some(name) = iter_name else { continue };
            let by_param = l
                .in_macro
                .and_then(|i| params.get(i))
                .is_some_and(|p| !p.is_empty() && p.contains(&name));
            if by_param || (l.in_macro.is_none() && name == "content") {
                var_name(l.target)?;
                return Some(true);
            }
        }
        Some(false)
    }
}

fn var_name<'s>(e: &Expr<'s>) -> Option<&'s str> {
    match e {
        Expr::Var(v) => Some(v.id),
        _ => None,
    }
}

/// Whether `e` reads variable `name` (`key` = None) or its item `key` (`name.key`,
/// `name['key']`), possibly through filters, tests and slices.
fn access(e: &Expr<'_>, name: &str, key: Option<&str>) -> bool {
    match e {
        Expr::Filter(f) => f.expr.as_ref().is_some_and(|x| access(x, name, key)),
        Expr::Test(t) => access(&t.expr, name, key),
        Expr::Slice(s) => access(&s.expr, name, key),
        _ => match key {
            None => matches!(e, Expr::Var(v) if v.id == name),
            Some(key) => match e {
                Expr::GetItem(g) => {
                    matches!(&g.expr, Expr::Var(v) if v.id == name)
                        && matches!(&g.subscript_expr, Expr::Const(c) if c.value.as_str() == Some(key))
                }
                Expr::GetAttr(g) => {
                    matches!(&g.expr, Expr::Var(v) if v.id == name) && g.name == key
                }
                _ => false,
            },
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ContentFormat::{OpenAi, String as Str};

    #[test]
    fn plain_templates_are_string() {
        assert_eq!(
            detect("{% for m in messages %}{{ m['content'] }}{% endfor %}"),
            Str
        );
        assert_eq!(detect("{{ messages[0].content }}"), Str);
        assert_eq!(detect("{% for %}"), Str, "a template that does not parse");
    }

    #[test]
    fn loops_over_content_are_openai() {
        let direct = "{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}";
        assert_eq!(detect(direct), OpenAi);
        let via_set =
            "{% set loop_messages = messages[1:] %}{% for message in loop_messages | reverse %}\
            {% if message.content is string %}{{ message.content }}{% else %}\
            {% for item in message.content %}{{ item.text }}{% endfor %}{% endif %}{% endfor %}";
        assert_eq!(detect(via_set), OpenAi);
        let by_macro =
            "{% macro render(c) %}{% for part in c %}{{ part.text }}{% endfor %}{% endmacro %}\
            {% for m in messages %}{{ render(m.content) }}{% endfor %}";
        assert_eq!(detect(by_macro), OpenAi);
        let by_kwarg =
            "{% macro render(x, c) %}{% for part in c %}{{ part.text }}{% endfor %}{% endmacro %}\
            {% for m in messages %}{{ render(1, c=m.content) }}{% endfor %}";
        assert_eq!(detect(by_kwarg), OpenAi);
        let bare = "{% for m in messages %}{% set content = m.content %}{% for c in content %}{% endfor %}{% endfor %}";
        assert_eq!(detect(bare), OpenAi);
    }

    #[test]
    fn a_macro_loop_over_something_else_is_string() {
        let t = "{% macro render(c) %}{% for part in c %}{{ part }}{% endfor %}{% endmacro %}\
            {% for m in messages %}{{ render(m.role) }}{% endfor %}";
        assert_eq!(detect(t), Str);
    }
}
