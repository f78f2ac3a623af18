//! Request bodies read the way the OpenAPI document's JSON Schema reads them.
//!
//! Two places where serde and JSON Schema disagree, both found by the API fuzzer:
//! - serde's derived structs also accept a JSON *array* of the fields in order (`[null, null]`
//!   is a `CreateEnrolment`); the document allows only objects. Here a struct is read from an
//!   object or refused.
//! - JSON Schema counts `1.0` and `1e2` as integers; serde refuses them for a `u32`. Here a
//!   number with no fractional part is read into an integer field however it is written.
//!
//! The body is parsed into a [`Value`] first (its size is already bounded by the route), then
//! read into the request type through [`Strict`], with the path of the offending field in the
//! error.

use serde::de::value::{MapDeserializer, SeqDeserializer};
use serde::de::{DeserializeOwned, Error as _, IntoDeserializer, Unexpected, Visitor};
use serde::forward_to_deserialize_any;
use serde_json::{Number, Value};

/// Reads `T` from an already parsed JSON value; the error names the field (`training.epochs:
/// invalid value …`).
pub fn from_value<T: DeserializeOwned>(value: Value) -> Result<T, String> {
    serde_path_to_error::deserialize(Strict(value)).map_err(|e| {
        let path = e.path().to_string();
        if path == "." {
            e.into_inner().to_string()
        } else {
            format!("{path}: {}", e.into_inner())
        }
    })
}

/// A JSON value read strictly (see the module's doc).
struct Strict(Value);

/// An integral number written as a float, as an integer; `None` for anything else.
fn integral(n: &Number) -> Option<Value> {
    let f = n.as_f64().filter(|_| n.is_f64())?;
    if f.fract() != 0.0 {
        return None;
    }
    // Both bounds are exact powers of two, so the comparisons are exact.
    if (0.0..18_446_744_073_709_551_616.0).contains(&f) {
        Some(Value::from(f as u64))
    } else if (-9_223_372_036_854_775_808.0..0.0).contains(&f) {
        Some(Value::from(f as i64))
    } else {
        None
    }
}

impl<'de> IntoDeserializer<'de, serde_json::Error> for Strict {
    type Deserializer = Strict;

    fn into_deserializer(self) -> Strict {
        self
    }
}

/// Integer targets take an integral number written as a float (only they: a free-form value, a
/// model's `params`, keeps its numbers as written).
macro_rules! integers {
    ($($method:ident)*) => {$(
        fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
            match self.0 {
                Value::Number(n) => match integral(&n) {
                    Some(i) => i.$method(visitor),
                    None => Value::Number(n).$method(visitor),
                },
                other => other.$method(visitor),
            }
        }
    )*};
}

impl<'de> serde::Deserializer<'de> for Strict {
    type Error = serde_json::Error;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        match self.0 {
            Value::Array(items) => {
                let mut seq = SeqDeserializer::new(items.into_iter().map(Strict));
                let out = visitor.visit_seq(&mut seq)?;
                seq.end()?;
                Ok(out)
            }
            Value::Object(fields) => {
                let mut map = MapDeserializer::new(fields.into_iter().map(|(k, v)| (k, Strict(v))));
                let out = visitor.visit_map(&mut map)?;
                map.end()?;
                Ok(out)
            }
            other => other.deserialize_any(visitor),
        }
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        match self.0 {
            Value::Null => visitor.visit_none(),
            _ => visitor.visit_some(self),
        }
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        match self.0 {
            Value::Object(_) => self.deserialize_any(visitor),
            Value::Array(_) => Err(serde_json::Error::invalid_type(Unexpected::Seq, &visitor)),
            other => other.deserialize_any(visitor),
        }
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        visitor.visit_newtype_struct(self)
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        name: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        // Externally tagged enums (the request types have only unit variants of these).
        self.0.deserialize_enum(name, variants, visitor)
    }

    integers! {
        deserialize_i8 deserialize_i16 deserialize_i32 deserialize_i64 deserialize_i128
        deserialize_u8 deserialize_u16 deserialize_u32 deserialize_u64 deserialize_u128
    }

    forward_to_deserialize_any! {
        bool f32 f64 char str string bytes byte_buf
        unit unit_struct seq tuple tuple_struct map identifier ignored_any
    }
}

#[cfg(test)]
mod tests {
    use hora_common::wire::{CreateEnrolment, CreateSyncJob, CreateTask, SecAggUnmask};
    use serde_json::json;

    use super::*;

    #[test]
    fn structs_are_read_from_objects_only() {
        let e: CreateEnrolment = from_value(json!({ "ttl_secs": 60 })).unwrap();
        assert_eq!(e.ttl_secs, Some(60));
        let err = from_value::<CreateEnrolment>(json!([null, null])).unwrap_err();
        assert!(err.contains("invalid type: sequence"), "{err}");
        let err = from_value::<SecAggUnmask>(json!({ "shares": [["a", "self_mask", "00"]] }))
            .unwrap_err();
        assert!(
            err.starts_with("shares[0]: invalid type: sequence"),
            "{err}"
        );
        let ok: SecAggUnmask =
            from_value(json!({ "shares": [{ "peer": "a", "kind": "self_mask", "share": "00" }] }))
                .unwrap();
        assert_eq!(ok.shares.len(), 1);
    }

    #[test]
    fn integral_numbers_are_integers_however_written() {
        let job: CreateSyncJob = from_value(json!({ "id": "j", "world_size": 4.0 })).unwrap();
        assert_eq!(job.world_size, 4);
        let job: CreateSyncJob = from_value(json!({ "id": "j", "world_size": 1e2 })).unwrap();
        assert_eq!(job.world_size, 100);
        for bad in [json!(4.5), json!(-1.0), json!(5e9), json!("4")] {
            let err =
                from_value::<CreateSyncJob>(json!({ "id": "j", "world_size": bad })).unwrap_err();
            assert!(err.starts_with("world_size: "), "{bad}: {err}");
        }
    }

    #[test]
    fn typos_defaults_tags_and_floats_still_work() {
        let task = json!({
            "id": "t", "initial_model": "00".repeat(32),
            "model": { "kind": "builtin", "name": "mlp", "params": { "hidden": [64, 32] } },
            "rounds": 3, "min_clients": 1.0, "target_clients": 2, "round_deadline_secs": 60,
            "training": { "learning_rate": 0.5, "optimizer": { "name": "adam" }, "on_deadline": "skip" },
        });
        let t: CreateTask = from_value(task.clone()).unwrap();
        assert_eq!((t.min_clients, t.training.learning_rate), (1, 0.5));
        assert_eq!(t.training.epochs, 1);
        let mut typo = task;
        typo["training"]["epoks"] = json!(2);
        let err = from_value::<CreateTask>(typo).unwrap_err();
        assert!(
            err.starts_with("training.epoks: unknown field `epoks`"),
            "{err}"
        );
    }
}
