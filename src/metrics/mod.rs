pub mod bertscore;
pub mod polarity;
