//! Batches as Arrow Flight data, every column sent with the type it has.
//!
//! arrow-flight 59's `FlightDataEncoder` writes a `LargeList` field into the schema message
//! as a `List`. With its dictionaries hydrated it also casts the column, so a reader gets
//! `List` where the query said `LargeList`. With its dictionaries resent it does not cast,
//! and the reader decodes the 64-bit offsets as 32-bit ones: a worker's block of
//! `LargeList` values came back to the driver as empty lists or failed to merge. This
//! encoder writes the schema as it is, with arrow's own IPC writer, and splits a large batch
//! into row slices that each fit one gRPC message.

use std::sync::Arc;

use arrow_flight::FlightData;
use arrow_flight::error::FlightError;
use datafusion::arrow::compute::cast;
use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::arrow::error::ArrowError;
use datafusion::arrow::ipc::CompressionType;
use datafusion::arrow::ipc::writer::{
    DictionaryTracker, IpcDataGenerator, IpcWriteContext, IpcWriteOptions,
};
use datafusion::arrow::record_batch::RecordBatch;
use futures::{Stream, StreamExt};

/// What becomes of a dictionary column.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dictionaries {
    /// Sent as a dictionary, its values again whenever they change: the reader gets the
    /// batch as it was (a block read back by the driver).
    Keep,
    /// A top-level dictionary column is sent as its values' type (a query's result for
    /// clients that may not read dictionaries); one nested in a list or struct stays one.
    Hydrate,
}

/// `batches` as Flight data: the schema message first (also when no batch comes), then
/// each batch's dictionaries and record batches, no message body much over
/// `max_message_bytes` unless one row is larger (measured before `compression`, which
/// Arrow IPC applies to each buffer and every reader undoes).
pub fn flight_data<S>(
    schema: SchemaRef,
    batches: S,
    dictionaries: Dictionaries,
    max_message_bytes: usize,
    compression: Option<CompressionType>,
) -> impl Stream<Item = Result<FlightData, FlightError>> + Send + 'static
where
    S: Stream<Item = Result<RecordBatch, FlightError>> + Send + 'static,
{
    let mut encoder = Encoder::new(schema, dictionaries, max_message_bytes, compression);
    let schema_message = encoder.schema_message();
    let messages = batches.flat_map(move |batch| {
        let messages = batch.and_then(|batch| Ok(encoder.batch_messages(batch)?));
        let messages: Vec<Result<FlightData, FlightError>> = match messages {
            Ok(messages) => messages.into_iter().map(Ok).collect(),
            Err(e) => vec![Err(e)],
        };
        futures::stream::iter(messages)
    });
    futures::stream::once(async move { Ok(schema_message) }).chain(messages)
}

/// The state of one Flight stream's IPC encoding (dictionaries already sent).
struct Encoder {
    /// The schema as sent.
    schema: SchemaRef,
    dictionaries: Dictionaries,
    max_message_bytes: usize,
    generator: IpcDataGenerator,
    tracker: DictionaryTracker,
    context: IpcWriteContext,
    options: IpcWriteOptions,
}

impl Encoder {
    fn new(
        schema: SchemaRef,
        dictionaries: Dictionaries,
        max_message_bytes: usize,
        compression: Option<CompressionType>,
    ) -> Self {
        let schema = Arc::new(sent_schema(&schema, dictionaries));
        // The default options (metadata V5) take every compression arrow is built with.
        let options = (IpcWriteOptions::default().try_with_compression(compression))
            .unwrap_or_else(|e| {
                log::warn!("blocks are sent uncompressed: {e}");
                IpcWriteOptions::default()
            });
        Self {
            schema,
            dictionaries,
            max_message_bytes: max_message_bytes.max(1),
            generator: IpcDataGenerator::default(),
            // A dictionary whose values change is sent again, not refused.
            tracker: DictionaryTracker::new(false),
            context: IpcWriteContext::default(),
            options,
        }
    }

    fn schema_message(&mut self) -> FlightData {
        self.generator
            .schema_to_bytes_with_dictionary_tracker(&self.schema, &mut self.tracker, &self.options)
            .into()
    }

    fn batch_messages(&mut self, batch: RecordBatch) -> Result<Vec<FlightData>, ArrowError> {
        let batch = match self.dictionaries {
            Dictionaries::Keep => batch,
            Dictionaries::Hydrate => {
                let columns = batch
                    .columns()
                    .iter()
                    .zip(self.schema.fields())
                    .map(
                        |(column, field)| match column.data_type() == field.data_type() {
                            true => Ok(Arc::clone(column)),
                            false => cast(column, field.data_type()),
                        },
                    )
                    .collect::<Result<Vec<_>, _>>()?;
                RecordBatch::try_new(Arc::clone(&self.schema), columns)?
            }
        };
        let mut messages = vec![];
        for piece in pieces(&batch, self.max_message_bytes) {
            let (dictionaries, data) = self.generator.encode(
                &piece,
                &mut self.tracker,
                &self.options,
                &mut self.context,
            )?;
            messages.extend(dictionaries.into_iter().map(FlightData::from));
            messages.push(data.into());
        }
        Ok(messages)
    }
}

/// The schema a stream of batches of `schema` is sent with: `schema` itself, or with
/// `Hydrate` each top-level dictionary field typed as its values (what a server announces
/// for a query should be this too).
pub fn sent_schema(schema: &Schema, dictionaries: Dictionaries) -> Schema {
    if dictionaries == Dictionaries::Keep {
        return schema.clone();
    }
    let fields: Vec<Field> = schema
        .fields()
        .iter()
        .map(|field| match field.data_type() {
            DataType::Dictionary(_, values) => {
                field.as_ref().clone().with_data_type(*values.clone())
            }
            _ => field.as_ref().clone(),
        })
        .collect();
    Schema::new_with_metadata(fields, schema.metadata().clone())
}

/// `batch` cut into row slices of at most about `max_bytes` each (by its buffers' size; a
/// batch under it, or of one row, stays whole).
fn pieces(batch: &RecordBatch, max_bytes: usize) -> Vec<RecordBatch> {
    let bytes: usize = batch
        .columns()
        .iter()
        .map(|column| column.get_buffer_memory_size())
        .sum();
    let count = bytes.div_ceil(max_bytes).clamp(1, batch.num_rows().max(1));
    let rows_per_piece = batch.num_rows().div_ceil(count).max(1);
    (0..batch.num_rows().max(1))
        .step_by(rows_per_piece)
        .map(|start| batch.slice(start, rows_per_piece.min(batch.num_rows() - start)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_flight::decode::FlightRecordBatchStream;
    use datafusion::arrow::array::{
        Array, ArrayRef, DictionaryArray, Int64Array, LargeListArray, ListArray, StringArray,
    };
    use datafusion::arrow::datatypes::{Int32Type, Int64Type};
    use futures::TryStreamExt;

    /// `batches` sent with `dictionaries` and read back as a Flight reader reads them.
    async fn round_trip(
        batches: Vec<RecordBatch>,
        dictionaries: Dictionaries,
        max_bytes: usize,
    ) -> Vec<RecordBatch> {
        round_trip_compressed(batches, dictionaries, max_bytes, None)
            .await
            .0
    }

    /// As [`round_trip`], compressed with `compression`; also the bytes of the messages'
    /// bodies as sent.
    async fn round_trip_compressed(
        batches: Vec<RecordBatch>,
        dictionaries: Dictionaries,
        max_bytes: usize,
        compression: Option<CompressionType>,
    ) -> (Vec<RecordBatch>, usize) {
        let schema = batches[0].schema();
        let stream = futures::stream::iter(batches.into_iter().map(Ok));
        let data: Vec<_> = flight_data(schema, stream, dictionaries, max_bytes, compression)
            .try_collect()
            .await
            .unwrap();
        let sent = data.iter().map(|d| d.data_body.len()).sum();
        let back = FlightRecordBatchStream::new_from_flight_data(futures::stream::iter(
            data.into_iter().map(Ok),
        ))
        .try_collect()
        .await
        .unwrap();
        (back, sent)
    }

    /// Compressed blocks come back as sent (a large list, dictionaries kept, cut into
    /// slices), in fewer bytes than uncompressed for repetitive columns.
    #[tokio::test]
    async fn compressed_blocks_come_back_as_sent_in_fewer_bytes() {
        let words: DictionaryArray<Int32Type> = (0..4000).map(|i| ["ab", "cd"][i % 2]).collect();
        let ids = Int64Array::from_iter_values((0..4000).map(|i| i / 10));
        let plain = RecordBatch::try_from_iter([
            ("w", Arc::new(words) as ArrayRef),
            ("id", Arc::new(ids) as ArrayRef),
        ])
        .unwrap();
        for batch in [plain, large_lists()] {
            let (_, raw) =
                round_trip_compressed(vec![batch.clone()], Dictionaries::Keep, 4 << 20, None).await;
            for compression in [CompressionType::LZ4_FRAME, CompressionType::ZSTD] {
                for max_bytes in [4 << 20, 4096] {
                    let (back, sent) = round_trip_compressed(
                        vec![batch.clone()],
                        Dictionaries::Keep,
                        max_bytes,
                        Some(compression),
                    )
                    .await;
                    let joined =
                        datafusion::arrow::compute::concat_batches(&batch.schema(), &back).unwrap();
                    assert_eq!(joined, batch, "{compression:?}, {max_bytes} B messages");
                    if max_bytes == 4 << 20 {
                        assert!(sent * 2 < raw, "{compression:?}: {sent} B against {raw} B");
                    }
                }
            }
        }
    }

    fn large_lists() -> RecordBatch {
        let values = (0..1000).map(|i| Some(vec![Some(i), Some(i + 1), None]));
        let lists = LargeListArray::from_iter_primitive::<Int64Type, _, _>(values);
        RecordBatch::try_from_iter([("v", Arc::new(lists) as ArrayRef)]).unwrap()
    }

    /// The bug this module exists for: `LargeList` comes back as `LargeList`, every value
    /// as sent (arrow-flight's encoder sent it as `List`: with dictionaries kept the values
    /// came back empty).
    #[tokio::test]
    async fn a_large_list_comes_back_as_sent() {
        for dictionaries in [Dictionaries::Keep, Dictionaries::Hydrate] {
            let batch = large_lists();
            let back = round_trip(vec![batch.clone()], dictionaries, 4 << 20).await;
            assert_eq!(back, vec![batch], "{dictionaries:?}");
        }
    }

    /// A batch over the message size comes back in row slices whose rows are the batch's,
    /// in order; one with no rows still sends its schema.
    #[tokio::test]
    async fn a_large_batch_is_cut_into_slices() {
        let batch = large_lists();
        let back = round_trip(vec![batch.clone()], Dictionaries::Keep, 4096).await;
        assert!(back.len() > 4, "{} pieces", back.len());
        let schema = batch.schema();
        let joined = datafusion::arrow::compute::concat_batches(&schema, &back).unwrap();
        assert_eq!(joined, batch);
        let empty = RecordBatch::new_empty(Arc::clone(&schema));
        let back = round_trip(vec![empty], Dictionaries::Keep, 4096).await;
        assert_eq!(back.iter().map(|b| b.num_rows()).sum::<usize>(), 0);
    }

    /// A dictionary column stays one when kept (its values sent again when they change),
    /// and arrives as its values when hydrated; a nested list keeps its type either way.
    #[tokio::test]
    async fn dictionaries_are_kept_or_hydrated() {
        let batch = |words: Vec<&str>| {
            let column: DictionaryArray<Int32Type> = words.into_iter().collect();
            let lists =
                ListArray::from_iter_primitive::<Int64Type, _, _>([Some(vec![Some(1)]), None]);
            RecordBatch::try_from_iter([
                ("w", Arc::new(column) as ArrayRef),
                ("l", Arc::new(lists) as ArrayRef),
            ])
            .unwrap()
        };
        let sent = vec![batch(vec!["a", "b"]), batch(vec!["c", "c"])];
        let back = round_trip(sent.clone(), Dictionaries::Keep, 4 << 20).await;
        assert_eq!(back, sent);
        let back = round_trip(sent, Dictionaries::Hydrate, 4 << 20).await;
        let words: Vec<&str> = back
            .iter()
            .flat_map(|b| {
                let w = b.column(0).as_any().downcast_ref::<StringArray>().unwrap();
                (0..w.len()).map(|i| w.value(i)).collect::<Vec<_>>()
            })
            .collect();
        assert_eq!(words, ["a", "b", "c", "c"]);
        assert!(matches!(back[0].column(1).data_type(), DataType::List(_)));
        let ids = back[0]
            .column(1)
            .as_any()
            .downcast_ref::<ListArray>()
            .unwrap();
        assert_eq!(
            ids.value(0)
                .as_any()
                .downcast_ref::<Int64Array>()
                .unwrap()
                .value(0),
            1
        );
    }
}
