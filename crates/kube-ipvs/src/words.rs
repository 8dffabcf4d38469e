//! Counted nouns for what people read: "1 virtual server", "2 virtual servers".

/// `n` and the noun in the number `n` asks for: `one` for 1, `many` otherwise.
#[must_use]
pub fn count<N>(n: N, one: &str, many: &str) -> String
where
    N: std::fmt::Display + PartialEq + From<u8>,
{
    if n == N::from(1) {
        format!("{n} {one}")
    } else {
        format!("{n} {many}")
    }
}

#[cfg(test)]
mod tests {
    use super::count;

    #[test]
    fn one_is_singular_and_every_other_count_plural() {
        assert_eq!(count(1, "group", "groups"), "1 group");
        assert_eq!(count(0, "group", "groups"), "0 groups");
        assert_eq!(count(2, "address", "addresses"), "2 addresses");
    }
}
