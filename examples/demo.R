# rvisor demo: output, a warning, a structured result and a plot, all
# captured by an embedded R worker.
cat("Fuel economy of", nrow(mtcars), "cars\n")
fit <- lm(mpg ~ wt, data = mtcars)
print(round(coef(fit), 3))
log(-1)  # a warning, shown with its call
plot(mtcars$wt, mtcars$mpg, xlab = "weight (1000 lbs)", ylab = "miles per gallon",
     main = "Heavier cars use more fuel")
abline(fit, col = "red")
rvisor_result(list(slope = unname(coef(fit)[2]), r_squared = summary(fit)$r.squared))
