//! The resolver: the packages asked for and their `Depends`, `Imports` and
//! `LinkingTo` closure, dependencies first, minus what is installed
//! already (base, recommended, site or tenant library).

use std::collections::{BTreeMap, BTreeSet};

use crate::index::Entry;
use crate::{PackageError, Policy};

/// The entries to install, dependencies before their dependents.
/// `installed` says whether a package is available already; `repos` names
/// the repositories for the unknown-package message.
pub fn resolve(
    wanted: &[String],
    index: &BTreeMap<String, Entry>,
    installed: &dyn Fn(&str) -> bool,
    policy: &Policy,
    repos: &str,
) -> Result<Vec<Entry>, PackageError> {
    let mut order = Vec::new();
    let mut done = BTreeSet::new();
    for w in wanted {
        visit(
            w,
            true,
            index,
            installed,
            policy,
            repos,
            &mut Vec::new(),
            &mut done,
            &mut order,
        )?;
    }
    Ok(order)
}

#[allow(clippy::too_many_arguments)]
fn visit(
    name: &str,
    asked: bool,
    index: &BTreeMap<String, Entry>,
    installed: &dyn Fn(&str) -> bool,
    policy: &Policy,
    repos: &str,
    path: &mut Vec<String>,
    done: &mut BTreeSet<String>,
    order: &mut Vec<Entry>,
) -> Result<(), PackageError> {
    if done.contains(name) {
        return Ok(());
    }
    if let Some(at) = path.iter().position(|p| p == name) {
        let mut cycle = path[at..].to_vec();
        cycle.push(name.into());
        return Err(PackageError::Cycle { cycle });
    }
    // A dependency already installed is used as it is; a package asked
    // for by name is checked against the lists even when installed.
    if asked {
        policy.check_name(name)?;
    }
    if !asked && installed(name) {
        done.insert(name.into());
        return Ok(());
    }
    policy.check_name(name)?;
    let Some(entry) = index.get(name) else {
        return Err(PackageError::Unknown {
            package: name.into(),
            repos: repos.into(),
        });
    };
    policy.check_compiled(name, entry.needs_compilation)?;
    path.push(name.into());
    for d in &entry.dependencies {
        visit(d, false, index, installed, policy, repos, path, done, order)?;
    }
    path.pop();
    done.insert(name.into());
    order.push(entry.clone());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Repository;

    fn index(spec: &[(&str, &[&str])]) -> BTreeMap<String, Entry> {
        let repo = Repository::parse("file:///r").unwrap();
        spec.iter()
            .map(|(n, d)| {
                (
                    n.to_string(),
                    Entry {
                        package: n.to_string(),
                        version: "1.0".into(),
                        dependencies: d.iter().map(|s| s.to_string()).collect(),
                        needs_compilation: false,
                        md5: None,
                        sha256: None,
                        repository: repo.clone(),
                    },
                )
            })
            .collect()
    }

    #[test]
    fn dependencies_come_first_and_installed_ones_are_skipped() {
        let ix = index(&[("pa", &["pb", "stats"]), ("pb", &["pc"]), ("pc", &[])]);
        let base = |n: &str| n == "stats" || n == "pc";
        let got = resolve(&["pa".into()], &ix, &base, &Policy::default(), "r").unwrap();
        let names: Vec<_> = got.iter().map(|e| e.package.as_str()).collect();
        assert_eq!(names, ["pb", "pa"]);
    }

    #[test]
    fn cycles_and_unknown_names_are_errors() {
        let ix = index(&[("pa", &["pb"]), ("pb", &["pa"])]);
        let none = |_: &str| false;
        match resolve(&["pa".into()], &ix, &none, &Policy::default(), "r") {
            Err(PackageError::Cycle { cycle }) => assert_eq!(cycle, ["pa", "pb", "pa"]),
            other => panic!("{other:?}"),
        }
        match resolve(&["pzz".into()], &ix, &none, &Policy::default(), "r") {
            Err(PackageError::Unknown { package, .. }) => assert_eq!(package, "pzz"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_denied_dependency_refuses_the_whole_install() {
        let ix = index(&[("pa", &["pb"]), ("pb", &[])]);
        let mut p = Policy::default();
        p.deny.insert("pb".into());
        let none = |_: &str| false;
        match resolve(&["pa".into()], &ix, &none, &p, "r") {
            Err(PackageError::Refused { package, rule, .. }) => {
                assert_eq!((package.as_str(), rule), ("pb", "deny"))
            }
            other => panic!("{other:?}"),
        }
    }
}
