# Draws the kernelspec logo (kernel/src/logo-32x32.png): Rscript scripts/kernel-logo.R FILE
png(commandArgs(TRUE)[1], width = 32, height = 32, bg = "transparent")
par(mar = c(0, 0, 0, 0))
plot.new(); plot.window(c(0, 1), c(0, 1))
rect(0.04, 0.04, 0.96, 0.96, col = "#2762b3", border = NA)
text(0.5, 0.5, "R", col = "white", font = 2, cex = 1.9)
invisible(dev.off())
