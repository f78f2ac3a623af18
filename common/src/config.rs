//! Layered configuration for every Hora program.
//!
//! Each option is declared once: a field of a struct that derives both `clap::Args` (its flag,
//! its `HORA_*` environment variable, its default and its help) and serde (its key in the
//! `--config` TOML file, the same name with underscores). [`layer`] then gives each option its
//! value from the first of these that says something:
//!
//! 1. the command line (`--flag`);
//! 2. the environment (`HORA_FLAG`);
//! 3. the TOML file given with `--config`;
//! 4. the declared default.
//!
//! The merging is figment's; clap says which of the first two set a value. [`Layered::report`]
//! lists every option with its effective value and where it came from, secrets masked (an
//! option is a secret when its declaration hides its environment value), for `config check`.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use clap::parser::ValueSource;
use clap::ArgMatches;
use figment::providers::{Format, Serialized, Toml};
use figment::value::{Dict, Map};
use figment::{Figment, Metadata, Profile, Provider};
use serde::de::DeserializeOwned;
use serde::Serialize;

/// Where an option's effective value came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "source", content = "from", rename_all = "lowercase")]
pub enum Source {
    /// The command line (the flag, e.g. `--data-dir`).
    Flag(String),
    /// An environment variable (its name).
    Env(String),
    /// The `--config` file (its path).
    File(PathBuf),
    /// The declared default (or nothing, for an option without one).
    Default,
}

impl Source {
    /// Flags beat the environment, which beats the file, which beats the default.
    pub fn rank(&self) -> u8 {
        match self {
            Source::Flag(_) => 3,
            Source::Env(_) => 2,
            Source::File(_) => 1,
            Source::Default => 0,
        }
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Flag(flag) => write!(f, "flag {flag}"),
            Source::Env(name) => write!(f, "environment {name}"),
            Source::File(path) => write!(f, "file {}", path.display()),
            Source::Default => f.write_str("default"),
        }
    }
}

/// A configuration that could not be put together: the file could not be read, or a value in
/// it is of the wrong type or unknown.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading the config file {path}: {error}")]
    Read {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{0}")]
    Invalid(String),
}

/// The options after layering, and where each came from.
#[derive(Debug)]
pub struct Layered<T> {
    pub value: T,
    sources: BTreeMap<String, Source>,
    secrets: Vec<String>,
    /// Each option's flag and environment variable, as declared.
    names: BTreeMap<String, (String, Option<String>)>,
}

/// One line of [`Layered::report`].
#[derive(Debug, Clone, Serialize)]
pub struct Setting {
    pub key: String,
    /// The value as the file would say it; `"(secret)"` for a secret that is set.
    pub value: serde_json::Value,
    #[serde(flatten)]
    pub source: Source,
    /// The flag that sets it (`--listen`).
    pub flag: Option<String>,
    /// The environment variable that sets it (`HORA_LISTEN`).
    pub env: Option<String>,
}

impl<T> Layered<T> {
    /// Where `key`'s value came from.
    pub fn source(&self, key: &str) -> Source {
        self.sources.get(key).cloned().unwrap_or(Source::Default)
    }

    /// A secret given directly (`key`) or as the first line of a file (`{key}_file`): the one
    /// from the higher layer wins; both in one layer is a mistake the user is told about.
    pub fn secret(
        &self,
        key: &str,
        value: Option<String>,
        file: Option<&Path>,
    ) -> Result<Option<String>, String> {
        let file_key = format!("{key}_file");
        let value = value.map(|v| (v, self.source(key)));
        let file = file.map(|f| (f, self.source(&file_key)));
        pick_secret((key, value), (&file_key, file))
    }

    /// Of two options that say one thing two ways (`--server` and `--peers`), which one is set
    /// from the higher layer: `Some(true)` the first, `Some(false)` the second, None when
    /// neither is set; both in one layer is a mistake the user is told about.
    pub fn higher(&self, a: (&str, bool), b: (&str, bool)) -> Result<Option<bool>, String> {
        match (a.1, b.1) {
            (false, false) => Ok(None),
            (true, false) => Ok(Some(true)),
            (false, true) => Ok(Some(false)),
            (true, true) => {
                let (sa, sb) = (self.source(a.0), self.source(b.0));
                match sa.rank().cmp(&sb.rank()) {
                    std::cmp::Ordering::Greater => Ok(Some(true)),
                    std::cmp::Ordering::Less => Ok(Some(false)),
                    std::cmp::Ordering::Equal => Err(format!(
                        "both `{}` and `{}` are set ({sa}); give one of them",
                        a.0, b.0
                    )),
                }
            }
        }
    }
}

impl<T: Serialize> Layered<T> {
    /// Every option with its effective value and its source, in declaration order of keys
    /// (alphabetical), secrets masked.
    pub fn report(&self) -> Vec<Setting> {
        let value = serde_json::to_value(&self.value).unwrap_or_default();
        let serde_json::Value::Object(map) = value else {
            return Vec::new();
        };
        map.into_iter()
            .map(|(key, value)| {
                let value = match value {
                    serde_json::Value::String(secret) if self.secrets.contains(&key) => {
                        format!("(secret, {} characters)", secret.chars().count()).into()
                    }
                    serde_json::Value::String(url) => mask_password(&url).into(),
                    value => value,
                };
                let (flag, env) = self.names.get(&key).cloned().unzip();
                Setting {
                    source: self.source(&key),
                    flag,
                    env: env.flatten(),
                    key,
                    value,
                }
            })
            .collect()
    }
}

/// `value` with the credentials of every URL in it masked, URLs separated by commas as
/// `--server` takes them: the user information (`https://user:***@host/`, `https://***@host/`
/// for a token given as the user name), and query parameters that carry a secret
/// (`?password=***`, `?sslpassword=***`, `?access_token=***`: any whose name, percent-decoded,
/// holds `password`, `secret`, `token`, `key`, `credential` or `signature`). A password may hold
/// `/`, `?`, `#` or `,` unencoded (PostgreSQL's parser takes them), so the credentials run to
/// the last `@`, a secret parameter's value to the next `&`, and a comma starts another URL only
/// where a scheme follows it: a URL is masked more than needed, never less. A string that is not
/// a URL is returned as it is.
pub fn mask_password(value: &str) -> String {
    let mut starts: Vec<usize> = value
        .match_indices(',')
        .map(|(at, _)| at + 1)
        .filter(|&at| scheme_at(&value[at..]))
        .collect();
    starts.insert(0, 0);
    let mut out = String::with_capacity(value.len());
    for (i, &start) in starts.iter().enumerate() {
        let end = starts.get(i + 1).map_or(value.len(), |&next| next - 1);
        if i > 0 {
            out.push(',');
        }
        out.push_str(&mask_url(&value[start..end]));
    }
    out
}

/// Whether `s` starts with `scheme://`.
fn scheme_at(s: &str) -> bool {
    s.split_once("://")
        .is_some_and(|(scheme, _)| is_scheme(scheme))
}

fn is_scheme(scheme: &str) -> bool {
    scheme.starts_with(|c: char| c.is_ascii_alphabetic())
        && scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))
}

fn mask_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://").filter(|(s, _)| is_scheme(s)) else {
        return url.to_string();
    };
    match rest.rsplit_once('@') {
        Some((userinfo, host)) => {
            let host = mask_query(host);
            match userinfo.split_once(':') {
                Some((user, _password)) => format!("{scheme}://{user}:***@{host}"),
                None => format!("{scheme}://***@{host}"),
            }
        }
        None => format!("{scheme}://{}", mask_query(rest)),
    }
}

/// `rest` (a URL past its credentials) with the values of its secret-bearing query parameters
/// masked, each to the next `&` (a fragment after one goes with it).
fn mask_query(rest: &str) -> String {
    let Some((head, query)) = rest.split_once('?') else {
        return rest.to_string();
    };
    let secret = |name: &str| {
        let name = percent_decode(name).to_ascii_lowercase();
        [
            "password",
            "secret",
            "token",
            "key",
            "credential",
            "signature",
        ]
        .iter()
        .any(|word| name.contains(word))
    };
    let query = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((name, value)) if secret(name) && !value.is_empty() => format!("{name}=***"),
            _ => pair.to_string(),
        })
        .collect::<Vec<_>>()
        .join("&");
    format!("{head}?{query}")
}

/// `s` with its `%XX` escapes decoded (invalid ones kept as they are).
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (
            bytes[i],
            bytes.get(i + 1).copied().and_then(hex),
            bytes.get(i + 2).copied().and_then(hex),
        ) {
            (b'%', Some(high), Some(low)) => {
                out.push((high * 16 + low) as u8);
                i += 3;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `config check`'s answer: one line per option, `key = value  (source)`, or with `json` one
/// object, `{"key": {"value": …, "source": "flag", "from": "--listen"}}`.
pub fn render(report: &[Setting], json: bool) -> Result<String, serde_json::Error> {
    if json {
        let map = report
            .iter()
            .map(|s| Ok((s.key.clone(), serde_json::to_value(s)?)))
            .collect::<Result<serde_json::Map<_, _>, serde_json::Error>>()?;
        return serde_json::to_string_pretty(&map);
    }
    let width = report.iter().map(|s| s.key.len()).max().unwrap_or(0);
    Ok(report
        .iter()
        .map(|s| match &s.value {
            serde_json::Value::Null => format!("{:<width$}   (not set)", s.key),
            value => format!("{:<width$} = {value}  ({})", s.key, s.source),
        })
        .collect::<Vec<_>>()
        .join("\n"))
}

/// The shells [`completions`] writes for.
pub use clap_complete::Shell;

/// Writes `shell`'s completion script for `command` (the whole program's) to `out`.
pub fn completions(mut command: clap::Command, shell: Shell, out: &mut dyn std::io::Write) {
    let name = command.get_name().to_string();
    clap_complete::generate(shell, &mut command, name, out);
}

/// The commands every program has for its own documentation, flattened into its subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum DocsCommand {
    /// Print the completion script of a shell (bash, zsh, fish, elvish, powershell), e.g.
    /// `hora-server completions bash > /etc/bash_completion.d/hora-server` (or hora-client).
    Completions {
        #[arg(value_enum)]
        shell: Shell,
    },
    /// Write the man pages of every command into a directory, and print their paths.
    Man {
        #[arg(long, default_value = "man")]
        dir: PathBuf,
    },
}

impl DocsCommand {
    /// Runs it for `command`, the whole program's.
    pub fn run(self, command: clap::Command) -> Result<(), String> {
        match self {
            DocsCommand::Completions { shell } => {
                completions(command, shell, &mut std::io::stdout());
            }
            DocsCommand::Man { dir } => {
                let pages = man_pages(command, &dir)
                    .map_err(|e| format!("writing man pages into {}: {e}", dir.display()))?;
                for page in pages {
                    println!("{}", page.display());
                }
            }
        }
        Ok(())
    }
}

/// Writes man pages for `command` (the whole program's) and each of its subcommands into `dir`
/// (`hora-server.1`, `hora-server-serve.1`, …); returns the files written.
pub fn man_pages(command: clap::Command, dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir)?;
    clap_mangen::generate_to(command, dir)?;
    let mut written: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "1"))
        .collect();
    written.sort();
    Ok(written)
}

/// Gives each renamed environment variable's value to its new name when only the old one is
/// set; returns those it moved, for [`warn_renamed`]. Call it first thing in `main`, before any
/// thread starts (setting the environment is sound only then).
pub fn rename_env(renamed: &[(&'static str, &'static str)]) -> Vec<(&'static str, &'static str)> {
    let mut moved = Vec::new();
    for &(old, new) in renamed {
        if let (Some(value), None) = (std::env::var_os(old), std::env::var_os(new)) {
            std::env::set_var(new, value);
            moved.push((old, new));
        }
    }
    moved
}

/// Tells the user to rename what [`rename_env`] moved (once logging is up).
pub fn warn_renamed(moved: &[(&str, &str)]) {
    for (old, new) in moved {
        tracing::warn!(
            "{old} is now {new}: rename it (the old name stops working in a later version)"
        );
    }
}

/// A secret given directly or as the first line of a file, each with where it came from: the one
/// from the higher layer wins; both from one layer is a mistake the user is told about.
pub fn pick_secret(
    (key, value): (&str, Option<(String, Source)>),
    (file_key, file): (&str, Option<(&Path, Source)>),
) -> Result<Option<String>, String> {
    match (value, file) {
        (None, None) => Ok(None),
        (Some((value, _)), None) => Ok(Some(value)),
        (None, Some((path, _))) => read_secret(path).map(Some),
        (Some((value, a)), Some((path, b))) => match a.rank().cmp(&b.rank()) {
            std::cmp::Ordering::Greater => Ok(Some(value)),
            std::cmp::Ordering::Less => read_secret(path).map(Some),
            std::cmp::Ordering::Equal => Err(format!(
                "both `{key}` and `{file_key}` are set ({a}); give one of them"
            )),
        },
    }
}

/// Where clap found argument `id` of `matches`: its `flag`, its `env` variable, or neither (the
/// default).
pub fn clap_source(matches: &ArgMatches, id: &str, flag: &str, env: &str) -> Source {
    match matches.value_source(id) {
        Some(ValueSource::CommandLine) => Source::Flag(flag.into()),
        Some(ValueSource::EnvVariable) => Source::Env(env.into()),
        _ => Source::Default,
    }
}

/// A secret kept in a file: its first line, trimmed. The file should be readable by its user
/// only.
pub fn read_secret(path: &Path) -> Result<String, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("reading the secret file {}: {e}", path.display()))?;
    let secret = text.lines().next().unwrap_or_default().trim().to_string();
    if secret.is_empty() {
        return Err(format!("the secret file {} is empty", path.display()));
    }
    Ok(secret)
}

/// The matches of the deepest subcommand: where a leaf's options (`serve`, `train`) are.
pub fn leaf(matches: &ArgMatches) -> &ArgMatches {
    let mut m = matches;
    while let Some((_, sub)) = m.subcommand() {
        m = sub;
    }
    m
}

/// Layers `parsed` (what clap made of the flags and the environment, defaults filled in) with
/// the TOML file at `file`: flags, then the environment, then the file, then the defaults.
/// `matches` are those `parsed` came from (see [`leaf`]). Fields that serde skips keep their
/// default in the result: carry them over from `parsed`.
pub fn layer<T>(
    parsed: &T,
    matches: &ArgMatches,
    file: Option<&Path>,
    renamed_keys: &[(&str, &str)],
) -> Result<Layered<T>, ConfigError>
where
    T: clap::Args + Serialize + DeserializeOwned,
{
    let command = T::augment_args(clap::Command::new("options"));
    let serde_json::Value::Object(all) = serde_json::to_value(parsed)
        .map_err(|e| ConfigError::Invalid(format!("the options: {e}")))?
    else {
        return Err(ConfigError::Invalid("the options are not a table".into()));
    };
    let mut flags = serde_json::Map::new();
    let mut env = serde_json::Map::new();
    let mut sources = BTreeMap::new();
    let mut secrets = Vec::new();
    let mut names = BTreeMap::new();
    for arg in command.get_arguments() {
        let id = arg.get_id().as_str();
        let Some(value) = all.get(id) else { continue };
        if arg.is_hide_env_values_set() {
            secrets.push(id.to_string());
        }
        let flag = arg
            .get_long()
            .map_or_else(|| id.to_string(), |l| format!("--{l}"));
        let env_name = arg.get_env().map(|e| e.to_string_lossy().into_owned());
        names.insert(id.to_string(), (flag.clone(), env_name.clone()));
        match matches.value_source(id) {
            Some(ValueSource::CommandLine) => {
                flags.insert(id.to_string(), value.clone());
                sources.insert(id.to_string(), Source::Flag(flag));
            }
            Some(ValueSource::EnvVariable) => {
                env.insert(id.to_string(), value.clone());
                sources.insert(id.to_string(), Source::Env(env_name.unwrap_or_default()));
            }
            _ => {}
        }
    }
    let mut figment = Figment::from(Named::new("the defaults", Serialized::defaults(parsed)));
    if let Some(path) = file {
        let text = std::fs::read_to_string(path).map_err(|error| ConfigError::Read {
            path: path.to_path_buf(),
            error,
        })?;
        let mut keys = Toml::string(&text)
            .data()
            .map_err(|e| {
                ConfigError::Invalid(format!("in the config file {}: {e}", path.display()))
            })?
            .remove(&Profile::Default)
            .unwrap_or_default();
        for (old, new) in renamed_keys {
            if let Some(value) = keys.remove(*old) {
                tracing::warn!(
                    "`{old}` in {} is now `{new}`: rename it (the old name stops working in a later version)",
                    path.display()
                );
                keys.entry(new.to_string()).or_insert(value);
            }
        }
        for key in keys.keys() {
            sources
                .entry(key.clone())
                .or_insert_with(|| Source::File(path.to_path_buf()));
        }
        figment = figment.merge(Named::new(
            format!("the config file {}", path.display()),
            Serialized::defaults(keys),
        ));
    }
    let figment = figment
        .merge(Named::new("the environment", Serialized::defaults(env)))
        .merge(Named::new("the command line", Serialized::defaults(flags)));
    let value = figment.extract::<T>().map_err(|e| {
        ConfigError::Invalid(
            e.into_iter()
                // Keys are shown under figment's profile; there is only one.
                .map(|e| e.to_string().replace("key \"default.", "key \""))
                .collect::<Vec<_>>()
                .join("; "),
        )
    })?;
    Ok(Layered {
        value,
        sources,
        secrets,
        names,
    })
}

/// A provider under a name of our choosing, so that an error says "in the config file …".
struct Named<P> {
    name: String,
    inner: P,
}

impl<P> Named<P> {
    fn new(name: impl Into<String>, inner: P) -> Self {
        Named {
            name: name.into(),
            inner,
        }
    }
}

impl<P: Provider> Provider for Named<P> {
    fn metadata(&self) -> Metadata {
        Metadata::named(self.name.clone())
    }

    fn data(&self) -> Result<Map<Profile, Dict>, figment::Error> {
        self.inner.data()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_in_urls_are_masked() {
        assert_eq!(
            mask_password("https://key:hunter2@s3.example:9000/bucket?x=1"),
            "https://key:***@s3.example:9000/bucket?x=1"
        );
        assert_eq!(
            mask_password("https://s3.example:9000"),
            "https://s3.example:9000"
        );
        assert_eq!(mask_password("https://TOKEN@host/"), "https://***@host/");
        assert_eq!(
            mask_password("postgres://u:pa/ss@db/hora"),
            "postgres://u:***@db/hora"
        );
        assert_eq!(
            mask_password("https://u:p@a:8443,https://v:q@b:8443"),
            "https://u:***@a:8443,https://v:***@b:8443"
        );
        assert_eq!(mask_password("plain:text@host"), "plain:text@host");
        assert_eq!(mask_password("{\"b\":\"c:d@e\"}"), "{\"b\":\"c:d@e\"}");
        // Credentials in the query: PostgreSQL's `password` and `sslpassword`, an object
        // store's keys, a token; other parameters and the fragment as they were.
        assert_eq!(
            mask_password("postgres://u@db/hora?sslmode=verify-full&password=hunter2"),
            "postgres://***@db/hora?sslmode=verify-full&password=***"
        );
        assert_eq!(
            mask_password("postgresql:///hora?host=/run/pg&sslpassword=p%40ss&user=u"),
            "postgresql:///hora?host=/run/pg&sslpassword=***&user=u"
        );
        assert_eq!(
            mask_password("https://s3.example/b?AWS_SECRET_ACCESS_KEY=abc&region=eu#top"),
            "https://s3.example/b?AWS_SECRET_ACCESS_KEY=***&region=eu#top"
        );
        assert_eq!(
            mask_password("https://a:8443/?access_token=t,https://b:8443/?token="),
            "https://a:8443/?access_token=***,https://b:8443/?token="
        );
        // A comma or a `#` inside a secret is masked with it; a comma starts a new URL only
        // where a scheme follows; a percent-encoded name is decoded before it is matched.
        assert_eq!(
            mask_password("postgres://db/h?password=abc,def&sslmode=require"),
            "postgres://db/h?password=***&sslmode=require"
        );
        assert_eq!(
            mask_password("postgres://u:a,b@db/h"),
            "postgres://u:***@db/h"
        );
        assert_eq!(
            mask_password("postgres://db/h?password=ab#cd"),
            "postgres://db/h?password=***"
        );
        assert_eq!(
            mask_password("postgres://db/h?pass%77ord=x&user=u"),
            "postgres://db/h?pass%77ord=***&user=u"
        );
        assert_eq!(
            mask_password("https://s3/b?X-Amz-Signature=abc#top"),
            "https://s3/b?X-Amz-Signature=***"
        );
    }
    use clap::{FromArgMatches, Parser};
    use serde::Deserialize;

    #[derive(Debug, clap::Args, Serialize, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Options {
        #[arg(long, env = "HORA_TEST_CONFIG_NAME", default_value = "hora")]
        name: String,
        #[arg(long, env = "HORA_TEST_CONFIG_COUNT")]
        count: Option<u64>,
        #[arg(long, env = "HORA_TEST_CONFIG_FLAG")]
        #[serde(default)]
        flag: bool,
        #[arg(long, env = "HORA_TEST_CONFIG_TOKEN", hide_env_values = true)]
        token: Option<String>,
        #[arg(long, env = "HORA_TEST_CONFIG_TOKEN_FILE")]
        token_file: Option<PathBuf>,
    }

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        options: Options,
    }

    fn layered(args: &[&str], file: Option<&str>) -> Result<Layered<Options>, ConfigError> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hora.toml");
        if let Some(text) = file {
            std::fs::write(&path, text).unwrap();
        }
        let matches = <Cli as clap::CommandFactory>::command()
            .try_get_matches_from(std::iter::once("test").chain(args.iter().copied()))
            .unwrap();
        let cli = Cli::from_arg_matches(&matches).unwrap();
        layer(
            &cli.options,
            &matches,
            file.map(|_| path.as_path()),
            &[("nom", "name")],
        )
    }

    #[test]
    fn flags_beat_the_file_which_beats_the_defaults() {
        let l = layered(&[], None).unwrap();
        assert_eq!((l.value.name.as_str(), l.value.count), ("hora", None));
        assert_eq!(l.source("name"), Source::Default);
        let l = layered(&[], Some("name = \"file\"\ncount = 3\nflag = true\n")).unwrap();
        assert_eq!((l.value.name.as_str(), l.value.count), ("file", Some(3)));
        assert!(l.value.flag);
        assert!(matches!(l.source("count"), Source::File(_)));
        let l = layered(&["--count", "4", "--name", "flag"], Some("count = 3\n")).unwrap();
        assert_eq!((l.value.name.as_str(), l.value.count), ("flag", Some(4)));
        assert_eq!(l.source("count"), Source::Flag("--count".into()));
    }

    #[test]
    fn a_renamed_key_of_the_file_still_counts() {
        let l = layered(&[], Some("nom = \"old\"\n")).unwrap();
        assert_eq!(l.value.name, "old");
        assert!(matches!(l.source("name"), Source::File(_)));
        let l = layered(&["--name", "flag"], Some("nom = \"old\"\n")).unwrap();
        assert_eq!(l.value.name, "flag");
    }

    #[test]
    fn the_file_is_checked() {
        let err = layered(&[], Some("cuont = 3\n")).unwrap_err();
        assert!(err.to_string().contains("cuont"), "{err}");
        let err = layered(&[], Some("count = \"three\"\n")).unwrap_err();
        assert!(err.to_string().contains("count"), "{err}");
        assert!(err.to_string().contains("hora.toml"), "{err}");
        let err = layered(&[], Some("count = [\n")).unwrap_err();
        assert!(err.to_string().contains("hora.toml"), "{err}");
    }

    #[test]
    fn secrets_are_masked_and_the_higher_layer_of_a_pair_wins() {
        let dir = tempfile::tempdir().unwrap();
        let secret = dir.path().join("token");
        std::fs::write(&secret, "from-the-file\n").unwrap();
        let file = "token = \"from-the-config\"\n";
        let l = layered(&["--token-file", secret.to_str().unwrap()], Some(file)).unwrap();
        let token = l
            .secret(
                "token",
                l.value.token.clone(),
                l.value.token_file.as_deref(),
            )
            .unwrap();
        assert_eq!(token.as_deref(), Some("from-the-file"));
        let report = l.report();
        let line = report.iter().find(|s| s.key == "token").unwrap();
        assert_eq!(line.value, serde_json::json!("(secret, 15 characters)"));
        let both = format!(
            "token = \"x\"\ntoken_file = {:?}\n",
            secret.to_str().unwrap()
        );
        let l = layered(&[], Some(&both)).unwrap();
        let err = l
            .secret(
                "token",
                l.value.token.clone(),
                l.value.token_file.as_deref(),
            )
            .unwrap_err();
        assert!(err.contains("give one of them"), "{err}");
    }
}
