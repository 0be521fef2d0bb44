//! Near misses of known key names: a misspelt key in an input file is refused by name (with the
//! key it resembles) instead of being ignored while a default stands in for it.

/// `s` lowercased without `-` and `_`: `Task`, `TASK`, `ta_sk` and `ta-sk` all read as `task`.
fn folded(s: &str) -> String {
    s.chars().filter(|c| *c != '-' && *c != '_').flat_map(char::to_lowercase).collect()
}

/// Edit distance with adjacent transpositions (optimal string alignment): `taks` is one edit
/// from `task`, as a typist sees it.
pub fn edit_distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    let (n, m) = (a.len(), b.len());
    let mut d = vec![vec![0usize; m + 1]; n + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for j in 0..=m {
        d[0][j] = j;
    }
    for i in 1..=n {
        for j in 1..=m {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut v = (d[i - 1][j] + 1).min(d[i][j - 1] + 1).min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                v = v.min(d[i - 2][j - 2] + 1);
            }
            d[i][j] = v;
        }
    }
    d[n][m]
}

/// The known key that `key` (not itself known) is a near miss of, if any: the same key ignoring
/// case, `-` and `_`; or within an edit distance that grows with the known key's length: 0 for
/// names of up to 3 characters (`id`: `qid` and `idx` are other keys, not typos of it), 1 for 4
/// or 5 (`tsk`, `taks` → `task`), 2 for longer ones (`questoin`, `contxt`, `answrs`). The
/// distance is measured on the folded names.
pub fn near_miss<'a>(key: &str, known: &[&'a str]) -> Option<&'a str> {
    if known.contains(&key) {
        return None;
    }
    let f = folded(key);
    let mut best: Option<(usize, &'a str)> = None;
    for &k in known {
        let fk = folded(k);
        let allowed = match fk.chars().count() {
            0..=3 => 0,
            4..=5 => 1,
            _ => 2,
        };
        let d = edit_distance(&f, &fk);
        if d <= allowed && best.is_none_or(|(bd, _)| d < bd) {
            best = Some((d, k));
        }
    }
    best.map(|(_, k)| k)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn near_misses() {
        let known = ["id", "_id", "question", "context", "answers", "answer", "task", "meta", "input", "query"];
        assert_eq!(near_miss("tsk", &known), Some("task"));
        assert_eq!(near_miss("taks", &known), Some("task"));
        assert_eq!(near_miss("Task", &known), Some("task"));
        assert_eq!(near_miss("ID", &known), Some("id"));
        assert_eq!(near_miss("questoin", &known), Some("question"));
        assert_eq!(near_miss("contxt", &known), Some("context"));
        assert_eq!(near_miss("answrs", &known), Some("answers"));
        assert_eq!(near_miss("empty_memroy", &["update", "final", "empty_memory"]), Some("empty_memory"));
        // keys of other datasets are not typos
        for other in ["qid", "idx", "type", "level", "length", "index", "title", "language", "all_classes", "metadata", "date"] {
            assert_eq!(near_miss(other, &known), None, "{other}");
        }
        assert_eq!(near_miss("task", &known), None);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
    }
}
