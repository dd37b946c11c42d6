//! Writing an error with its causes, for logs and messages.

/// An error and its causes on one line (`error: cause: cause`), formatted when written: how
/// idemgate's own log lines show a [`StoreError`](crate::store::StoreError) and its source.
///
/// ```
/// use idemgate::ErrorChain;
///
/// let error = std::io::Error::other("disk full");
/// assert_eq!(ErrorChain(&error).to_string(), "disk full");
/// ```
#[derive(Clone, Copy, Debug)]
pub struct ErrorChain<'a>(pub &'a (dyn std::error::Error + 'static));

impl std::fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(cause) = source {
            write!(f, ": {cause}")?;
            source = cause.source();
        }
        Ok(())
    }
}
