//! The UniFFI facade over `loams-core` (DESIGN.md section 8): what the SwiftUI and Compose apps call.
